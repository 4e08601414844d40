"""Layer-wise push on P against vLLM's own scheduler: the connector installed through
vLLM's factory in a real ``AsyncScheduler`` over a KV cache of a few blocks, driven step
by step with made-up model outputs (no model runs, no daemon).

With async scheduling vLLM schedules step N+1 before it processed step N. A request whose
prefill ends in step N (its ``SendStart`` in that step's metadata, P's daemon reading its
blocks from then on) still runs in that schedule, and when another request's blocks do not
fit vLLM preempts the last running request: P is a ``kv_producer``, so the victim's blocks
go back to the pool at once and into the next allocation, without ``request_finished``.
"""

from __future__ import annotations

import json

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16
USABLE_BLOCKS = 6  # vLLM keeps one more, its null block
P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-1"}


class Engine:
    """vLLM's scheduler with the connector as vLLM builds it, and the steps in flight."""

    def __init__(self, model_dir: str, usable_blocks: int = USABLE_BLOCKS) -> None:
        model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=512, dtype="float32")
        sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                                enable_chunked_prefill=True, is_encoder_decoder=False,
                                long_prefill_token_threshold=40, scheduler_reserve_full_isl=False)
        kv = KVTransferConfig(kv_connector="PushsvcConnector", kv_connector_module_path="pushsvc_connector",
                              kv_role="kv_producer", kv_connector_extra_config={"layerwise_push": True})
        # The device named: a CUDA build of vLLM on a host without a GPU infers none.
        config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK), scheduler_config=sched,
                            kv_transfer_config=kv, device_config=DeviceConfig(device="cpu"))
        config.scheduler_config.async_scheduling = True  # vLLM's default on a GPU (the CPU platform turns it off)
        config.cache_config.num_gpu_blocks = usable_blocks + 1
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
        kv_cache = KVCacheConfig(num_blocks=usable_blocks + 1, kv_cache_tensors=[],
                                 kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.scheduler = AsyncScheduler(vllm_config=config, kv_cache_config=kv_cache,
                                        structured_output_manager=StructuredOutputManager(config), block_size=BLOCK,
                                        log_stats=False)
        self.connector = self.scheduler.connector
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)  # as vLLM's engine core
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK, hash_fn)
        self._sampling: dict[int, list[str]] = {}  # id(step): the requests whose prefill it completes

    def add(self, rid: str, prompt_tokens: int, max_tokens: int, params: dict | None = None) -> Request:
        extra = {"kv_transfer_params": dict(params)} if params else None
        token = 3 + len(self.scheduler.requests)  # prompts of their own: no prefix hits between them
        request = Request(rid, [token] * prompt_tokens, SamplingParams(max_tokens=max_tokens,
                                                                               extra_args=extra), None,
                          block_hasher=self._hasher)
        self.scheduler.add_request(request)
        return request

    def schedule(self) -> SchedulerOutput:
        step = self.scheduler.schedule()
        self._sampling[id(step)] = [rid for rid in step.num_scheduled_tokens
                                    if self.scheduler.requests[rid].num_computed_tokens
                                    >= self.scheduler.requests[rid].num_prompt_tokens]
        return step

    def process(self, step: SchedulerOutput, finished_sending: set[str] | None = None) -> None:
        """The step's model output comes back (with the workers' reports, if any)."""
        ids = list(step.num_scheduled_tokens)
        sampling = self._sampling.pop(id(step))
        output = ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                                   sampled_token_ids=[[7] if rid in sampling else [] for rid in ids],
                                   kv_connector_output=KVConnectorOutput(finished_sending=finished_sending)
                                   if finished_sending else None)
        self.scheduler.update_from_output(step, output)

    def blocks_of(self, rid: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])


def allocated(step: SchedulerOutput) -> dict[str, set[int]]:
    """The blocks each request was given in ``step``."""
    out = {new.req_id: set(new.block_ids[0]) for new in step.scheduled_new_reqs}
    cached = step.scheduled_cached_reqs
    for rid, groups in zip(cached.req_ids, cached.new_block_ids):
        if groups is not None:
            out.setdefault(rid, set()).update(groups[0])
    return out


@pytest.fixture
def model_dir(tmp_path) -> str:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
              "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
              "bos_token_id": 1, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_started_push_keeps_its_blocks_when_the_next_step_runs_out_of_kv(model_dir) -> None:
    engine = Engine(model_dir)
    engine.add("long", 200, max_tokens=1)  # a chunked prefill, 40 tokens a step
    pushed = engine.add("p1", 20, max_tokens=1, params=P_PARAMS)
    first = engine.schedule()
    start = first.kv_connector_metadata.layerwise["p1"]
    assert first.num_scheduled_tokens == {"long": 40, "p1": 20}, "p1's whole prefill ends in this step"
    start_blocks = set(start.block_ids[0])
    # Scheduled while the first step runs: "long" needs 2 more blocks, 1 is free, and p1
    # is the last running request. vLLM waits instead of preempting it.
    second = engine.schedule()
    assert second.preempted_req_ids in (None, set()) and pushed.status == RequestStatus.RUNNING
    assert not any(blocks & start_blocks for blocks in allocated(second).values())
    assert set(engine.blocks_of("p1")) == start_blocks
    engine.process(first)
    assert pushed.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not engine.connector.has_pending_block_frees(), "cleared by its end, not by its push"
    engine.process(second)
    third = engine.schedule()
    assert third.kv_connector_metadata.sends["p1"].block_ids == start.block_ids, "its verdict"
    assert not any(blocks & start_blocks for blocks in allocated(third).values()), "held until finished sending"
    engine.process(third, finished_sending={"p1"})
    assert "p1" not in engine.scheduler.requests
    fourth = engine.schedule()
    assert fourth.num_scheduled_tokens.get("long"), "the long prefill goes on once p1's push settled"


def test_a_p_request_that_goes_on_decoding_is_pushed_whole_once_finished(model_dir) -> None:
    engine = Engine(model_dir, usable_blocks=20)
    direct = engine.add("direct", 20, max_tokens=3, params=P_PARAMS)  # a client calling P itself
    previous = engine.schedule()
    seen = [previous]
    while not direct.is_finished():
        step = engine.schedule()  # before the previous step's output is back
        seen.append(step)
        assert not engine.connector.has_pending_block_frees(), "vLLM may preempt it as it decodes"
        engine.process(previous)
        previous = step
        assert len(seen) < 10
    engine.process(previous)
    assert not any(step.kv_connector_metadata.layerwise for step in seen), "its blocks outlive its prefill step"
    verdict = engine.schedule().kv_connector_metadata.sends["direct"]
    assert verdict.block_ids == [engine.blocks_of("direct")] and verdict.match_key == "xfer-1"


def test_a_started_push_whose_request_a_cache_reset_preempts_is_fenced_and_started_anew(model_dir) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` (vLLM's pause with a cache
    reset, say, for a weight update) preempts every running request, a started one too:
    its blocks go back to the pool with no hook of the connector's. The next step's
    metadata names it, so the worker fences its push before that step's forward pass."""
    engine = Engine(model_dir, usable_blocks=20)
    pushed = engine.add("p1", 20, max_tokens=1, params=P_PARAMS)
    first = engine.schedule()
    start = first.kv_connector_metadata.layerwise["p1"]
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert pushed.status == RequestStatus.PREEMPTED
    engine.process(first)
    assert pushed.status != RequestStatus.FINISHED_LENGTH_CAPPED, "its first run's output is dropped"
    second = engine.schedule()
    meta = second.kv_connector_metadata
    assert meta.preempted_starts == ["p1"], "fenced before the forward pass that may reuse its blocks"
    assert meta.dropped_starts == [] and "p1" not in meta.sends
    restart = meta.layerwise["p1"]
    assert restart.match_key == start.match_key and restart.block_ids == [engine.blocks_of("p1")]
    engine.process(second)
    assert pushed.status == RequestStatus.FINISHED_LENGTH_CAPPED
    verdict = engine.schedule().kv_connector_metadata
    assert verdict.sends["p1"].block_ids == restart.block_ids and verdict.preempted_starts == []
