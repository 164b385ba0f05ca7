"""A tiny, random-weight default model that needs no download.

Tests and examples need *some* Hugging Face causal LM that works offline.
This module builds one locally in a few seconds (`--model
splitserve-default-llama`; what splitserve serves without `--model` is a real
one, see `shared.engine.model_registry`):

- `build_tokenizer` trains a byte-level BPE tokenizer on a short English
  corpus kept in this file, so any UTF-8 text round-trips.
- `build_random_model` writes a random-weight model directory (config,
  safetensors weights, generation config, tokenizer) for several
  architectures; tests use it to make models of other shapes.
- `default_model_dir` builds the default small Llama once and caches it.
- `build_once` is how anything lands in the cache: built in a temp dir,
  renamed into place, under a file lock.

Everything is deterministic: the same arguments give byte-identical files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The served-model name the default model is exposed under.
DEFAULT_MODEL_NAME = "splitserve-default-llama"

# Bump the suffix whenever the tokenizer, corpus, config or init changes,
# so stale caches are never reused.
DEFAULT_MODEL_DIRNAME = "default-llama-v1"

# Special tokens. None is added automatically on encode.
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN]

# Target vocabulary size, counting the 256-byte alphabet and special tokens.
TOKENIZER_VOCAB_SIZE = 2048

# ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Weight init scale for the default model, chosen by measurement on greedy
# decoding (8 prompts x 64 tokens, then 4 prompts x 200 tokens):
# - 0.02: collapses to one repeated token (1-18 distinct of 64);
# - 0.1: 60-63 distinct of 64, top-2 logit margin >= 1e-3 on 99.5% of steps,
#   attention stays soft (mean max weight ~0.4), so every cached KV entry
#   matters -- good for catching KV-cache bugs;
# - 0.15+: as varied, but attention turns nearly one-hot.
DEFAULT_INIT_STD = 0.1

# A small Llama with grouped-query attention (8 query heads share 2 KV heads).
DEFAULT_MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 688,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

# Original prose written for this project; only used to train the tokenizer.
TOKENIZER_CORPUS = """\
The lighthouse keeper woke before the gulls. She climbed the spiral stairs,
counted one hundred and twelve steps, and wiped the salt from the great lens.
Outside, the sea was the colour of pewter, and a single fishing boat was
working its way around the northern rocks. She wrote the time in the log:
5:42 in the morning, wind from the west, visibility fair.

Baking bread is mostly a lesson in patience. You mix flour, water, salt and a
little yeast, and then you wait. The dough rises while you do something else:
you sweep the floor, you answer a letter, you forget about it entirely. When
you come back, it has doubled, soft and slightly sour, and the kitchen smells
like a warm morning even if it is raining outside.

"Are you coming to the market on Saturday?" asked Tomas.
"Only if the weather holds," said Mira. "Last week the stalls blew over."
"Then we should go early, before the wind picks up."
"Early means six o'clock, and you have never once been awake at six."
He laughed and admitted that she was probably right.

The river begins as a trickle under a flat grey stone high in the hills. By
the time it reaches the valley it has gathered a dozen small streams, and it
turns the wheel of an old mill that nobody uses any more. Children throw
sticks from the bridge and run to the other side to see which one wins. In
summer the water is low and clear; in spring it is brown, loud and fast.

A computer does exactly what it is told, which is both its greatest strength
and its most annoying habit. If you ask it to add two numbers, it will add
them a billion times a second without complaint. If you forget a comma, it
will stop and refuse to continue until you find the mistake. Programmers
spend much of their time reading error messages and asking themselves why
the machine disagrees with what they thought they wrote.

def greet(name):
    message = "Hello, " + name + "!"
    return message

for i in range(10):
    print(i, i * i, greet("world"))

The train left the station at 7:15 and rolled slowly through the suburbs,
past gardens with washing on the line, past a school where a bell was ringing,
past a football field where two dogs were chasing the same ball. A conductor
walked through the carriage checking tickets. Most passengers were reading,
sleeping, or staring out of the window at the fields that opened up once the
city was behind them.

In the garden, the tomatoes were late this year. The beans climbed their poles
quickly, the lettuce bolted in the heat, and the pumpkins spread across half
the lawn. The gardener kept a notebook of what worked and what failed: plant
the carrots deeper, water the roses in the evening, never trust a warm April.
Every winter she read it again and promised herself to do better.

Numbers have their own personalities. Seven feels lucky, thirteen feels
unlucky, and zero is strange because it is both nothing and a very important
something. Twelve is friendly because it divides so neatly into halves,
thirds and quarters. One hundred is round and proud. A million is too large
to imagine, so people picture a stadium full of faces, or a beach full of sand.

Questions are often more useful than answers. Why does the sky turn red at
sunset? How do birds find their way south? What would happen if the moon
were twice as close? Who decided that a week should have seven days? When
you ask a good question, you open a door; when you accept an answer too
quickly, you sometimes close one.

The old library had creaking floors and tall windows. On rainy afternoons
students filled every chair, whispering over maps, poems and chemistry
textbooks. The librarian knew where every book belonged and could tell,
just from the sound of footsteps, whether someone was lost or simply in a
hurry. She kept a jar of pencils on the desk for anyone who needed one.

Shopping list: eggs, milk, butter, three apples, a loaf of rye bread, coffee,
rice, onions, garlic, olive oil, lemons, and something sweet for Sunday.
Remember to return the empty bottles and to pick up the parcel from the post
office before it closes at noon.

Winter arrived quietly. First the leaves fell, then the mornings turned sharp
and bright, and finally one night the snow came down without a sound. In the
morning the whole town was white. Cars moved slowly, neighbours cleared their
paths with shovels, and a small boy built a crooked snowman with a carrot
nose and two buttons for eyes.

The engineer explained the bridge with her hands. "The weight pushes down
here, and the arch turns that push sideways, into the banks. Stone is very
strong when you squeeze it and very weak when you pull it, so the whole shape
is designed to keep every stone squeezed." Her students nodded, drew careful
diagrams, and wondered how anyone had worked this out before calculators.

Tea or coffee? It is a question that divides families. Some people cannot
think until they have had a strong cup of coffee; others prefer the slow
ritual of tea, the kettle, the pot, the few minutes of waiting. A few people
drink neither and are regarded with gentle suspicion by everyone else.

A good map leaves things out. It does not show every tree, every stone, or
every puddle; it shows the roads, the rivers, the towns and the hills that
matter for the journey. Choosing what to leave out is the real skill of the
mapmaker, and the same is true of anyone who writes a summary, tells a story,
or explains an idea to a friend.

At the harbour, the ferry sounded its horn twice. Passengers hurried up the
ramp with bags, bicycles and a surprised-looking goat on a rope. The captain
checked the clock, waved to the harbour master, and the boat pulled away from
the pier, leaving a long white line across the calm water of the bay.

Learning a language feels like walking into a dark room and slowly finding the
light switches. At first every sentence is a puzzle. Then, one day, you
understand a joke, or you dream in the new words, or you order dinner without
rehearsing it first. The room is never fully lit, but it becomes a place you
can live in.

Memory is not a recording. Each time we remember something, we rebuild it from
pieces: a smell, a colour, a voice, a feeling. That is why two friends can
remember the same afternoon so differently, and why an old photograph can
surprise us by showing a detail we were certain was never there.

The clock in the square has been ten minutes slow for as long as anyone can
remember. Visitors check their watches and frown. Residents simply add ten
minutes in their heads and carry on. Once, a committee proposed to repair it,
but the town voted against the idea, because the slow clock had become part of
what made the square feel like home.

The orchestra tuned their instruments while the audience settled. Violins,
cellos, a harp, two bassoons and a nervous trumpeter filled the hall with a
cloud of unrelated notes. Then the conductor lifted her baton, the murmuring
stopped, and for a moment the only sound was somebody's umbrella dripping
quietly onto the polished wooden floor.

Volcanoes, glaciers, deserts and jungles: geography classes make the planet
sound tidy, divided into chapters. In reality the boundaries are blurry. A
mountain slope may hold a pine forest, an alpine meadow, a frozen lake and a
hot spring within a single afternoon's hike, each with its own insects,
mosses, lizards and birds.

Recipe for a quick vegetable soup: chop two carrots, one leek, a potato and a
stick of celery. Soften them in butter for ten minutes, add a litre of stock,
simmer for twenty-five minutes, then blend until smooth. Season with pepper,
nutmeg, and a squeeze of lemon juice. Serves four hungry people, or two very
hungry ones.

The astronomer adjusted the telescope, checked her spreadsheet, and waited for
the clouds to drift away. Jupiter appeared first, bright and steady, with
four tiny moons lined up beside it like beads on a thread. She photographed
them every twenty minutes until dawn, recording temperatures, exposures and
coordinates in a battered notebook.

Carpentry rewards the careful. Measure twice, cut once; sharpen the chisel
before it becomes dull; follow the grain rather than fighting it. A
well-made drawer slides shut with a soft sigh of air, and a wobbly chair can
often be rescued with glue, clamps, and an evening of quiet, methodical work.

Electricity travels through copper wires, but the electrons themselves drift
surprisingly slowly. What moves quickly is the electromagnetic field, a
pattern of pushes passed along from atom to atom. Understanding this
difference puzzles many students, and explaining it clearly is a favourite
challenge for physics teachers everywhere.

The marathon runners gathered at dawn, stretching hamstrings, adjusting
shoelaces and sipping water. Some wore costumes: a banana, a dinosaur, a
superhero with a cardboard cape. At exactly eight o'clock the starting pistol
cracked, and twelve thousand pairs of trainers began pounding the avenue.

Budget for July: rent 950, groceries 320, electricity 64, internet 35,
transport 120, insurance 48, savings 200, and 80 for unexpected expenses.
Total: 1817. Note to self: cancel the unused gym membership, compare phone
contracts, and ask the landlord about the broken thermostat.

Honeybees communicate through a remarkable waggle dance. A forager returning
to the hive shakes her abdomen while moving in a figure-eight; the angle of
the dance indicates the direction of flowers relative to the sun, and its
duration suggests the distance. Her sisters follow, memorise, and fly off.

Philosophy begins with curiosity and sometimes ends in confusion. Is a ship
still the same ship after every plank has been replaced? Can we know anything
for certain? Does free will exist, or merely the feeling of choosing? These
puzzles seem abstract until someone asks them during dinner, and then the
whole table argues cheerfully for hours.
"""


def _corpus_lines() -> list[str]:
    """Split the corpus into paragraphs-sized chunks for the trainer."""
    return [chunk for chunk in TOKENIZER_CORPUS.split("\n\n") if chunk.strip()]


def _train_bpe():
    """Train a byte-level BPE tokenizer on the built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Byte-level: every UTF-8 byte maps to a visible symbol, no prefix space,
    # so encode/decode is an exact round trip for any text.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    return tok


def _wrap_tokenizer(tok):
    """Wrap a `tokenizers.Tokenizer` as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # keep decode an exact inverse
        model_max_length=DEFAULT_MODEL_CONFIG["max_position_embeddings"],
    )


def build_tokenizer(out_dir: Path) -> None:
    """Train the byte-level BPE tokenizer and save it into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _wrap_tokenizer(_train_bpe()).save_pretrained(str(out_dir))


def _config_kwargs(overrides: dict[str, Any]) -> dict[str, Any]:
    """Default shape merged with `overrides`, with a consistent head_dim."""
    kwargs = dict(DEFAULT_MODEL_CONFIG)
    kwargs.update(overrides)
    # Mistral and Qwen3 default head_dim to 128; derive it unless given.
    if "head_dim" not in overrides:
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    return kwargs


def _disable_sliding_window(config) -> None:
    """Make every layer full attention, whatever the architecture."""
    if hasattr(config, "use_sliding_window"):
        config.use_sliding_window = False
    if hasattr(config, "sliding_window"):
        config.sliding_window = None
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"] * config.num_hidden_layers


def _make_config(model_type: str, vocab_size: int, token_ids: dict[str, int], overrides: dict[str, Any]):
    """Build the transformers config for a random model."""
    from transformers import AutoConfig

    kwargs = _config_kwargs(overrides)
    kwargs.update(vocab_size=vocab_size, dtype="float32", **token_ids)
    config = AutoConfig.for_model(model_type, **kwargs)
    _disable_sliding_window(config)
    if config.max_position_embeddings < 4096:
        raise ValueError("max_position_embeddings must be at least 4096")
    return config


def _init_weights(model, seed: int, init_std: float) -> None:
    """Re-initialise every parameter from one seeded generator, in order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters() lists a tied weight once and in a fixed order.
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                # Matrices and embeddings.
                param.copy_(torch.normal(0.0, init_std, param.shape, generator=gen))
            elif name.endswith("bias"):
                # Biases (e.g. Qwen2 q/k/v) are small but non-zero, so an
                # engine that drops them gives visibly different results.
                param.copy_(torch.normal(0.0, init_std, param.shape, generator=gen))
            else:
                # RMSNorm weights (layer norms, Qwen3 q/k norms).
                param.fill_(1.0)


def _generation_config(token_ids: dict[str, int]):
    """Generation config so `generate()` stops at EOS and pads with PAD."""
    from transformers import GenerationConfig

    return GenerationConfig(**token_ids)


def build_random_model(
    out_dir: Path,
    *,
    model_type: str = "llama",
    seed: int = 0,
    init_std: float | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight causal LM (with tokenizer) into `out_dir`.

    `model_type` is any decoder-only architecture transformers knows
    (tested: llama, mistral, qwen2, qwen3). `config_overrides` change the
    default shape, e.g. `num_key_value_heads=1` or `tie_word_embeddings=True`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    build_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    token_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = _make_config(model_type, len(tokenizer), token_ids, config_overrides)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed, DEFAULT_INIT_STD if init_std is None else init_std)
    model.generation_config = _generation_config(token_ids)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def cache_root() -> Path:
    """`$SPLITSERVE_CACHE_DIR`, or `~/.cache/splitserve`."""
    env = os.environ.get("SPLITSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "splitserve"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive fcntl lock on `path` (created if missing)."""
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_atomically(final: Path, build: Callable[[Path], None]) -> None:
    """Run `build` on a temp sibling of `final`, then rename it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        _make_readable(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _make_readable(directory: Path) -> None:
    """mkdtemp makes a 0700 dir; let other users share the cached model."""
    os.chmod(directory, 0o755)
    for path in directory.iterdir():
        os.chmod(path, 0o644)


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """`final`, made by `build(tmp_dir)` unless it already exists.

    The directory only ever appears complete (it is renamed into place), and
    a file lock beside it makes concurrent first callers, threads or
    processes, build it once.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{final.name}.lock"):
        if not final.is_dir():  # another process may have built it meanwhile
            _build_atomically(final, build)
    return final


def _default_build_args() -> dict[str, Any]:
    """Arguments `default_model_dir` passes to `build_random_model`."""
    return {"model_type": "llama", "seed": 0, "init_std": DEFAULT_INIT_STD, **DEFAULT_MODEL_CONFIG}


def default_model_dir() -> Path:
    """Path of the cached default model, built on first use."""
    return build_once(cache_root() / "models" / DEFAULT_MODEL_DIRNAME,
                      lambda tmp: build_random_model(tmp, **_default_build_args()))
