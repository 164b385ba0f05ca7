"""`to_flags`: a settings object as the command line its service's parser reads back (`services.common.settings`)."""

from services.common.settings import secret_env, to_flags
from services.decode.__main__ import settings_of as decode_settings
from services.decode.settings import DecodeSettings
from services.gateway.settings import GatewayServiceSettings


def test_what_was_set_or_differs_is_rendered_and_nothing_else():
    settings = DecodeSettings(instance_id="decode-0", kv_store=False, prefill_timeout=2.5, cpus=(0, 1, 3),
                              max_model_len=None)
    assert to_flags(settings) == ("--instance-id", "decode-0", "--cpus", "0,1,3", "--no-kv-store",
                                  "--prefill-timeout", "2.5")
    assert decode_settings(list(to_flags(settings)), environ={}) == settings


def test_whole_floats_lose_their_point_and_true_is_the_bare_flag():
    flags = to_flags(DecodeSettings(instance_id="d", drain_timeout=6.0, kv_store=True))
    assert flags[flags.index("--drain-timeout") + 1] == "6" and "--kv-store" in flags


def test_a_secret_goes_by_its_variable_and_a_mapping_as_its_flag_spells_it():
    settings = GatewayServiceSettings(instance_id="gateway-0", api_keys=("k1", "k2"), expect={"decode": 2})
    flags = to_flags(settings)
    assert not any("k1" in flag for flag in flags) and "--api-key" not in flags
    assert flags[flags.index("--expect") + 1] == "decode=2"
    assert secret_env(settings) == {"SPLITSERVE_API_KEY": "k1,k2"}
    assert secret_env(GatewayServiceSettings(instance_id="g")) == {}
