"""Heterogeneous TP, the pure parts: which ranks pair (state/tp.py), the head slice of a
block (layout.head_slice), what the connector says of vLLM's KV tensors (head-major or
not, KV heads per layer), what P checks of a D agent and its PUSH_REG (remotes.py), and,
for D TP = k x P TP, what one WRITE into a joint agent of D's ranks carries
(layout.joint_source, layout.joined) and who hears of a joint agent."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from pushsvc.errors import LayoutError
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.server.ranks import RankMemory
from pushsvc.server.remotes import registration_error, view_of
from pushsvc.state import tp
from pushsvc.state.layout import (
    MAX_DESCRIPTORS,
    Layout,
    RegionSpec,
    check_compatible,
    descriptor_table,
    head_slice,
    joined,
    joint_source,
    plan_write,
    replicated,
    source_view,
)
from pushsvc_connector.connector import kv_heads, replicated_layers
from pushsvc_connector.kvlayout import head_major, regions_of

# ---------------------------------------------------------------- which ranks pair


@given(d_tp=st.integers(1, 8), k=st.integers(1, 8))
def test_every_p_rank_writes_into_exactly_one_d_rank_and_each_d_rank_hears_from_k(d_tp: int, k: int) -> None:
    p_tp = d_tp * k
    assert tp.refusal(p_tp, d_tp) == "" and tp.ratio(p_tp, d_tp) == k
    covered = [s for j in range(d_tp) for s in tp.sources(j, d_tp, p_tp)]
    assert covered == list(range(p_tp)), "the sources of D's ranks partition P's ranks, in order"
    for s in range(p_tp):
        d_rank, index = tp.served(s, p_tp, d_tp)
        assert s in tp.sources(d_rank, d_tp, p_tp) and index == list(tp.sources(d_rank, d_tp, p_tp)).index(s)
        # Both sides agree on the pair, whichever asks.
        assert tp.pairs(s, p_tp, d_rank, d_tp) and tp.pairs(d_rank, d_tp, s, p_tp)
        assert sum(tp.pairs(s, p_tp, j, d_tp) for j in range(d_tp)) == 1


@pytest.mark.parametrize(("p_tp", "d_tp", "words"), [
    (1, 2, "a D TP above P's is served by D's joint agents"),
    (2, 4, "a D TP above P's is served by D's joint agents"),
    (3, 2, "P TP must be a multiple of D TP"),
    (6, 4, "P TP must be a multiple of D TP"),
])
def test_unsupported_tp_pairs_are_named(p_tp: int, d_tp: int, words: str) -> None:
    why = tp.refusal(p_tp, d_tp)
    assert why.startswith(f"P TP {p_tp} -> D TP {d_tp}: ") and words in why
    assert not tp.pairs(0, p_tp, 0, d_tp) or p_tp < d_tp  # a refused pair with P above D pairs nothing


@given(p_tp=st.integers(1, 8), k=st.integers(2, 8))
def test_each_p_rank_writes_into_one_joint_whose_members_partition_d_ranks(p_tp: int, k: int) -> None:
    d_tp = p_tp * k
    assert tp.joint_refusal(p_tp, d_tp) == "" and p_tp in tp.joint_sizes(d_tp)
    covered = [r for i in range(p_tp) for r in tp.members(i, d_tp, p_tp)]
    assert covered == list(range(d_tp)), "the joints' members partition D's ranks, in order"
    for r in range(d_tp):
        joint, index = tp.joint_of(r, d_tp, p_tp)
        assert tp.members(joint, d_tp, p_tp)[index] == r
    # A P rank loads D's joint agent of its own TP, never D's ranks of a higher TP; D's
    # ranks never load P's agents of a lower TP (their joint does).
    assert tp.direct("producer", p_tp, p_tp, remote_members=k)
    assert not tp.direct("producer", p_tp, d_tp) and not tp.direct("consumer", d_tp, p_tp)
    assert not tp.direct("consumer", p_tp, p_tp, remote_members=k)
    assert not tp.direct("producer", p_tp * 2, p_tp, remote_members=k), "a joint pairs at its own TP only"


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 3), (3, 4), (2, 6 + 1)])
def test_a_d_tp_that_p_tp_does_not_divide_is_named(p_tp: int, d_tp: int) -> None:
    assert tp.joint_refusal(p_tp, d_tp) == f"P TP {p_tp} -> D TP {d_tp}: D TP must be a multiple of P TP"
    assert p_tp not in tp.joint_sizes(d_tp)


# ---------------------------------------------------------------- head slices


def _layout(heads: int = 4, block_len: int = 64, blocks: int = 5, stride: int = 0) -> Layout:
    return Layout(tuple(RegionSpec(base, block_len, blocks, stride or block_len, g, heads)
                        for base, g in ((0x10000, 0), (0x20000, 1))))


@pytest.mark.parametrize("parts", [2, 4])
def test_the_head_slices_of_a_block_tile_it_in_rank_order(parts: int) -> None:
    full = _layout(stride=96)  # blocks further apart than their length: the slices keep the stride
    table = descriptor_table(full)
    slices = [descriptor_table(head_slice(full, parts, i)) for i in range(parts)]
    for row in range(len(table)):
        addr, length, _ = (int(x) for x in table[row])
        pieces = [(int(s[row][0]), int(s[row][1])) for s in slices]
        assert pieces == [(addr + i * length // parts, length // parts) for i in range(parts)]
    assert all(r.heads == 4 // parts for r in head_slice(full, parts, 1).regions)
    assert head_slice(full, 1, 0) is full


def test_a_p_rank_pairs_its_whole_blocks_with_its_slice_of_ds() -> None:
    d = _layout(block_len=64)
    p = Layout(tuple(RegionSpec(0x90000 + i * 0x1000, 32, 8, 32, r.group, 2) for i, r in enumerate(d.regions)))
    view = head_slice(d, 2, 1)
    plan = plan_write(p, view, [[1, 2], [3]], [[4, 0], [2]])
    src, dst = descriptor_table(p)[plan.src_indices], descriptor_table(view)[plan.dst_indices]
    assert (src[:, 1] == dst[:, 1]).all() and plan.nbytes == 3 * 32
    assert [int(a) for a in dst[:, 0]] == [0x10000 + 4 * 64 + 32, 0x10000 + 32, 0x20000 + 2 * 64 + 32]


@pytest.mark.parametrize(("heads", "parts", "words"), [
    (0, 2, "not head-major"),
    (1, 2, "not head-major"),
    (2, 4, "do not split between 4 P ranks"),
    (3, 2, "do not split between 2 P ranks"),
])
def test_blocks_that_cannot_be_split_by_head_are_refused(heads: int, parts: int, words: str) -> None:
    with pytest.raises(LayoutError, match=words):
        head_slice(_layout(heads=heads, block_len=96), parts, 0)


def test_a_slice_index_out_of_range_is_refused() -> None:
    with pytest.raises(LayoutError):
        head_slice(_layout(), 2, 2)


# ---------------------------------------------------------------- what the connector registers


@pytest.mark.parametrize(("shape", "permute", "heads", "want"), [
    ((6, 4, 16, 32), None, 4, 4),  # vLLM CPU: [blocks, heads, block_size, 2*head]
    ((6, 16, 4, 8), None, 4, 0),  # NHD [blocks, block_size, heads, head]: heads interleaved
    ((6, 16, 4, 8), (0, 2, 1, 3), 4, 4),  # HND: the same view, heads stored outermost
    ((6, 16, 576), None, 1, 0),  # MLA: one latent row per token, nothing to split
    ((6, 4, 16, 32), None, 0, 0),  # heads unknown
])
def test_head_major_reads_the_blocks_storage_order(shape, permute, heads: int, want: int) -> None:
    t = torch.zeros(shape, dtype=torch.bfloat16)
    if permute is not None:  # storage in the permuted order, the view in vLLM's logical one
        t = torch.zeros([shape[i] for i in permute], dtype=torch.bfloat16).permute(*np.argsort(permute))
        assert tuple(t.shape) == shape
    assert head_major(t[0], heads) == want
    (region,) = regions_of("layer.0", t, 0, 0, shape[0], heads)
    assert region.heads == want


def test_flash_attention_k_and_v_halves_say_their_heads_too() -> None:
    hnd = torch.zeros((2, 6, 4, 16, 8), dtype=torch.bfloat16)  # [2, blocks, heads, block_size, head]
    nhd = torch.zeros((2, 6, 16, 4, 8), dtype=torch.bfloat16)  # FlashAttention's default
    assert [r.heads for r in regions_of("l", hnd, 0, 0, 6, 4)] == [4, 4]
    assert [r.heads for r in regions_of("l", nhd, 0, 0, 6, 4)] == [0, 0]


def test_kv_heads_come_from_vllms_kv_cache_specs() -> None:
    full = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=16, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, sliding_window=32)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a", "b"], full), KVCacheGroupSpec(["c"], window), KVCacheGroupSpec(["d"], mla)])
    assert kv_heads(config) == {"a": 4, "b": 4, "c": 2, "d": 1}
    assert kv_heads(None) == {}


# ---------------------------------------------------------------- what P checks


def _agent(rank: int, tp_size: int, heads: int = 4) -> pp.AgentInfo:
    return pp.AgentInfo(rank=rank, tp_size=tp_size, agent_name=f"d/r{rank}", metadata=b"m",
                        regions=[pp.RegionInfo(base=0x10000, block_len=64, num_blocks=8, heads=heads)])


def _reg(d_rank: int, d_tp: int, p_tp: int) -> notif.PushReg:
    return notif.PushReg(request_id="r", decode_engine_id="decode", decode_host="h", decode_port=1,
                         decode_tp_size=d_tp, local_block_ids=[[1]], remote_engine_id="prefill", remote_host="h",
                         remote_port=2, remote_tp_size=p_tp, decode_rank=d_rank)


def test_each_p_rank_sees_only_its_slice_of_its_d_rank() -> None:
    d0 = _agent(0, 1)
    assert view_of(d0, 0, 1).regions[0].base == 0x10000 and view_of(d0, 0, 1).regions[0].block_len == 64
    assert [(r.base, r.block_len) for r in view_of(d0, 1, 2).regions] == [(0x10000 + 32, 32)]
    assert [(r.base, r.block_len) for r in view_of(_agent(1, 2), 3, 4).regions] == [(0x10000 + 32, 32)]
    with pytest.raises(LayoutError, match="not the D rank 0"):
        view_of(_agent(1, 2), 1, 4)
    with pytest.raises(LayoutError, match="not head-major"):
        view_of(_agent(0, 1, heads=0), 1, 2)
    with pytest.raises(LayoutError, match="D TP above"):
        view_of(_agent(0, 2), 0, 1)


@pytest.mark.parametrize(("p_rank", "p_tp", "reg", "reason"), [
    (1, 2, _reg(0, 1, 2), None),
    (0, 1, _reg(0, 1, 1), None),
    (1, 2, _reg(0, 1, 1), "push_reg_tp"),  # D thinks P runs TP 1: it would count one completion
    (0, 2, _reg(0, 1, 4), "push_reg_tp"),
])
def test_a_push_reg_must_name_ps_tp_and_come_to_a_rank_that_serves_it(p_rank, p_tp, reg, reason) -> None:
    error = registration_error("decode", _agent(0, 1), reg, p_rank, p_tp)
    assert (error and error[0]) == reason
    if reason:
        assert "TP" in error[1]


def test_a_d_rank_registering_with_a_p_rank_that_does_not_serve_it_is_refused() -> None:
    error = registration_error("decode", _agent(1, 2), _reg(1, 2, 4), 0, 4)  # P rank 0 serves D rank 0
    assert error is not None and error[0] == "push_reg_tp" and "does not take KV from P rank 0" in error[1]


def test_a_push_regs_blocks_are_checked_against_the_layout_its_agents_hello_described() -> None:
    from pushsvc.server.peers import Peer

    peer = Peer("daemon", "decode", "127.0.0.1", 1)
    hello = peer.agents["d/r0"] = _agent(0, 1)
    described = peer.described("d/r0")
    assert peer.described("d/r0") is described, "made once per announcement"
    beyond = msgspec.structs.replace(_reg(0, 1, 1), local_block_ids=[[8]])  # the agent describes 8 blocks
    error = registration_error("decode", hello, beyond, 0, 1, described)
    assert error is not None and error[0] == "push_reg_blocks"
    # A new announcement of the same agent (a bigger KV, say) is described anew.
    again = peer.agents["d/r0"] = msgspec.structs.replace(
        hello, regions=[pp.RegionInfo(base=0x10000, block_len=64, num_blocks=16, heads=4)])
    assert peer.described("d/r0") is not described
    assert registration_error("decode", again, beyond, 0, 1, peer.described("d/r0")) is None
    # Agents no longer announced are not kept: at most one layout per announced agent.
    for i in range(1, 5):
        del peer.agents[f"d/r{i - 1}"]
        peer.agents[f"d/r{i}"] = msgspec.structs.replace(hello, agent_name=f"d/r{i}")
        peer.described(f"d/r{i}")
    assert set(peer._described) == {"d/r4"}


# ---------------------------------------------------------------- replicated KV (MLA)


def test_mla_layers_are_replicated_and_say_so_in_their_regions() -> None:
    full = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=16, dtype=torch.bfloat16)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["m0", "m1"], mla)])
    assert replicated_layers(config) == {"m0", "m1"} and replicated_layers(None) == frozenset()
    t = torch.zeros((6, 16, 576), dtype=torch.bfloat16)
    (region,) = regions_of("m0", t, 0, 0, 6, 1, replicated=True)
    assert (region.heads, region.replicated) == (0, True)


def _mla_agent(rank: int, tp_size: int) -> pp.AgentInfo:
    return pp.AgentInfo(rank=rank, tp_size=tp_size, agent_name=f"d/r{rank}", metadata=b"m",
                        regions=[pp.RegionInfo(base=0x10000, block_len=576 * 32, num_blocks=8, replicated=True)])


def test_replicated_kv_is_written_whole_by_the_first_p_rank_only() -> None:
    whole = view_of(_mla_agent(0, 1), 0, 2)
    assert [(r.base, r.block_len) for r in whole.regions] == [(0x10000, 576 * 32)] and replicated(whole)
    assert tp.writer(1, 2, 4) == 2
    assert [(r.base, r.block_len) for r in view_of(_mla_agent(1, 2), 2, 4).regions] == [(0x10000, 576 * 32)]
    with pytest.raises(LayoutError, match="written by the first of 2 P ranks only, not by the one of slice 1"):
        view_of(_mla_agent(0, 1), 1, 2)
    with pytest.raises(LayoutError, match="first of 2 P ranks only"):
        view_of(_mla_agent(1, 2), 3, 4)
    mixed = Layout((RegionSpec(0, 64, 4, 64, 0, 0, True), RegionSpec(256, 64, 4, 64, 0, 4, False)))
    assert not replicated(mixed) and not replicated(Layout(()))


def test_source_view_is_the_one_rule_of_what_a_p_rank_writes_of_a_d_block() -> None:
    """P (what it WRITEs into) and D (what it refuses, what it verifies) use this one rule."""
    heads = Layout((RegionSpec(0x1000, 256, 4, 256, 0, 4), RegionSpec(0x9000, 128, 4, 128, 1, 2)))
    assert source_view(heads, 1, 0) is heads
    second = source_view(heads, 2, 1)
    assert [(r.base, r.block_len, r.stride, r.heads) for r in second.regions] == [
        (0x1000 + 128, 128, 256, 2), (0x9000 + 64, 64, 128, 1)]
    assert source_view(heads, 2, 1) == head_slice(heads, 2, 1)
    with pytest.raises(LayoutError, match="do not split between 4 P ranks"):
        source_view(heads, 4, 0)
    latent = Layout((RegionSpec(0, 64, 4, 64, 0, 0, True),))
    assert source_view(latent, 1, 0) is latent and source_view(latent, 4, 0) is latent
    with pytest.raises(LayoutError, match="first of 4 P ranks only"):
        source_view(latent, 4, 3)


# ---------------------------------------------------------------- D TP above P's: joint agents


def _memory(layout: Layout, size: int, seed: int) -> np.ndarray:
    """The bytes of an address space ``size`` long that ``layout``'s bases point into."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _apply(plan, src_table: np.ndarray, src: np.ndarray, dst_table: np.ndarray, dst: np.ndarray) -> None:
    """Carry out ``plan`` the way NIXL would: descriptor i of P's list into descriptor j of D's."""
    for s, d in zip(plan.src_indices, plan.dst_indices):
        s_addr, s_len, _ = (int(x) for x in src_table[s])
        d_addr, d_len, _ = (int(x) for x in dst_table[d])
        assert s_len == d_len
        dst[d_addr:d_addr + d_len] = src[s_addr:s_addr + s_len]


@pytest.mark.parametrize("k", [2, 4])
def test_one_write_into_a_joint_puts_head_slice_j_of_ps_blocks_into_member_j(k: int) -> None:
    heads, block_len, blocks = 8, 256, 6
    p = Layout(tuple(RegionSpec(base, block_len, blocks, block_len, 0, heads) for base in (0, 4096)))
    # D's members: each holds heads/k of every block, regions at its own place in the one
    # address space the daemon maps them in.
    members = [Layout(tuple(RegionSpec(8192 + m * 4096 + r * 2048, block_len // k, blocks, block_len // k, 0,
                                       heads // k) for r in range(2))) for m in range(k)]
    joint = joined(members)
    source = joint_source(p, k)
    assert len(source.regions) == len(joint.regions) == 2 * k
    mem = _memory(p, 8192 + k * 4096, seed=k)
    before = mem.copy()
    p_blocks, d_blocks = [[4, 1, 5]], [[0, 3, 2]]
    plan = plan_write(source, joint, p_blocks, d_blocks)
    _apply(plan, descriptor_table(source), mem, descriptor_table(joint), mem)
    part = block_len // k
    for m, layout in enumerate(members):
        for r, region in enumerate(layout.regions):
            for pb, db in zip(p_blocks[0], d_blocks[0]):
                got = mem[region.base + db * part:region.base + (db + 1) * part]
                want = before[p.regions[r].base + pb * block_len + m * part:
                              p.regions[r].base + pb * block_len + (m + 1) * part]
                assert np.array_equal(got, want), f"member {m}, region {r}, D block {db}"
            untouched = [b for b in range(blocks) if b not in d_blocks[0]]
            for b in untouched:
                span = slice(region.base + b * part, region.base + (b + 1) * part)
                assert np.array_equal(mem[span], before[span]), "a block D did not register was written"
    assert plan.nbytes == len(p_blocks[0]) * 2 * block_len, "P's whole blocks, once"


def test_replicated_kv_goes_whole_into_every_member_of_a_joint() -> None:
    p = Layout((RegionSpec(0x1000, 576, 4, 576, 0, 0, True),))
    members = [Layout((RegionSpec(0x9000 + m * 0x1000, 576, 4, 576, 0, 0, True),)) for m in range(2)]
    source = joint_source(p, 2)
    assert source.regions == p.regions * 2
    check_compatible(source, joined(members))


def test_p_blocks_that_do_not_split_by_d_tp_are_refused_naming_d_ranks() -> None:
    with pytest.raises(LayoutError, match="not head-major, they cannot be split between 2 D ranks"):
        joint_source(_layout(heads=0), 2)
    with pytest.raises(LayoutError, match="do not split between 4 D ranks"):
        joint_source(_layout(heads=2), 4)
    assert joint_source(_layout(), 1) == _layout()


def test_members_whose_kernel_blocks_differ_are_not_joined() -> None:
    a, b = Layout(_layout().regions, 1), Layout(_layout().regions, 2)
    with pytest.raises(LayoutError, match="kernel blocks per logical block differ"):
        joined([a, b])


def test_joint_agents_reach_only_peers_that_know_them() -> None:
    plain = pp.AgentInfo(rank=0, tp_size=2, agent_name="d/r0/x.1", metadata=b"m", regions=[])
    joint = pp.AgentInfo(rank=0, tp_size=1, agent_name="d/j0of1/x.2", metadata=b"m", regions=[], members=2)
    assert pp.announceable([plain, joint], pp.JOINT_MINOR) == [plain, joint]
    assert pp.announceable([plain, joint], pp.JOINT_MINOR - 1) == [plain]
    assert b"members" not in msgspec.msgpack.encode(plain), "an agent of one rank encodes as 1.5 did"
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(joint), type=pp.AgentInfo) == joint


def test_a_joint_of_more_members_than_ps_descriptors_allow_is_refused_before_anything_is_built() -> None:
    """A peer names ``members``: a joint of 1024 D ranks over P's replicated rows would
    describe every P block 1024 times. P refuses it (the push fails layout_mismatch)
    without building the descriptors or preparing a list."""
    blocks = MAX_DESCRIPTORS // 512 + 1
    layout = Layout((RegionSpec(0x1000, 576, blocks, 576, 0, 0, True),))

    class NoAgent:
        def prep_local(self, *_a: object) -> None:
            raise AssertionError("nothing may be prepared")

    memory = RankMemory(buffers=[], regions=[], layout=layout, descs=np.empty((0, 3), dtype=np.uint64), dlist=object())
    with pytest.raises(LayoutError, match="over the limit"):
        memory.joint_source(NoAgent(), 1024)  # type: ignore[arg-type]
    assert memory.joint_sources == {}
    assert memory.joint_view(2).total_descriptors == 2 * blocks
