"""`KVFromElsewhere`: a test connector in the shape of a remote prefill. It loads the whole prompt of chosen
requests from KV another engine exported, written part by part in the order given, and brings the first token
sampled there."""

from shared.engine.continuation import Continuation, KVOrigin
from shared.engine.kv_connector import KVConnector, LoadEnd


class KVFromElsewhere(KVConnector):
    def __init__(self, engine, parts, first_token, *, request_ids, ok=True, over=False, num_cached_tokens=0,
                 kv_origin=KVOrigin.COMPUTED):
        """`parts`: [(data, layout)] of every layer (a tensor or a view of another cache's blocks)."""
        self.engine, self.parts, self.first_token = engine, parts, first_token
        self.request_ids = set(request_ids)
        self.ok, self.over = ok, over
        self.continuation = Continuation(output_token_ids=[first_token], num_cached_tokens=num_cached_tokens,
                                         kv_origin=kv_origin)
        self.loads, self.ended, self._done = [], [], []

    def external_prefix(self, request_id, token_ids, num_local_tokens):
        return len(token_ids) - num_local_tokens if request_id in self.request_ids else 0

    def start_load(self, request_id, block_ids, first_token, num_tokens):
        self.loads.append((request_id, first_token, num_tokens, len(block_ids)))
        if self.ok:
            for data, layout in self.parts:
                self.engine.write_kv(block_ids, data, layout)
        self._done.append(LoadEnd(request_id, self.ok, self.continuation, request_over=self.over))

    def finished_loads(self):
        done, self._done = self._done, []
        return done

    def request_finished(self, request_id):
        self.ended.append(request_id)
