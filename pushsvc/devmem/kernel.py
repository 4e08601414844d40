"""The landing copy kernel, as PTX the CUDA driver compiles when a device is first used
(no toolkit, no torch, no Triton in the daemon: docs/gpu.md).

``copy_blocks_<W>`` copies, for pair ``x`` and entry ``first + y`` of a ``CopyPlan``
table (``state/landing.py``), the bytes ``[z * chunk, min((z + 1) * chunk, nbytes))`` of
one block, ``W`` bytes per access (W in 16, 8, 4, 2, 1: the plan's ``width``). With slot
``s = slot_base + x`` and block ``b = map[s]``: landing (``gather`` 0) copies source block
``s`` (a landing slot) to destination block ``b`` (the worker's); staging (``gather`` 1)
copies source block ``b`` (the worker's) to destination block ``s`` (a staging slot). A
block out of the entry's range copies nothing (the host checks pairs before a launch;
this is the second line).

Parameters, in order: ``table`` (u64 address), ``map`` (u64 address of the int64
slot -> block map of the group), ``slot_base`` (u64), ``first`` (u32), ``chunk`` (u64),
``gather`` (u32).
"""

from __future__ import annotations

WIDTHS = (16, 8, 4, 2, 1)
THREADS = 256
CHUNK = 64 << 10  # bytes of one entry one thread block copies

_ACCESS = {  # width -> (registers, load/store type, value operand)
    16: (".reg .b32 %v<4>;", "v4.u32", "{%v0, %v1, %v2, %v3}"),
    8: (".reg .b64 %v<1>;", "u64", "%v0"),
    4: (".reg .b32 %v<1>;", "u32", "%v0"),
    2: (".reg .b16 %v<1>;", "u16", "%v0"),
    1: (".reg .b16 %v<1>;", "u8", "%v0"),
}

_ENTRY = """
.visible .entry copy_blocks_{w}(
    .param .u64 p_table, .param .u64 p_map, .param .u64 p_slot_base,
    .param .u32 p_first, .param .u64 p_chunk, .param .u32 p_gather)
{{
    .reg .pred %p<5>;
    .reg .b32 %r<9>;
    .reg .b64 %rd<28>;
    {regs}

    ld.param.u64 %rd1, [p_table];
    ld.param.u64 %rd2, [p_map];
    ld.param.u64 %rd3, [p_slot_base];
    ld.param.u32 %r1, [p_first];
    ld.param.u64 %rd4, [p_chunk];
    ld.param.u32 %r8, [p_gather];
    setp.ne.u32 %p4, %r8, 0;
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ctaid.y;
    mov.u32 %r4, %ctaid.z;
    mov.u32 %r5, %tid.x;
    mov.u32 %r6, %ntid.x;

    cvt.u64.u32 %rd5, %r2;
    add.u64 %rd6, %rd3, %rd5;
    shl.b64 %rd7, %rd6, 3;
    add.u64 %rd7, %rd2, %rd7;
    ld.global.u64 %rd27, [%rd7];
    selp.b64 %rd8, %rd6, %rd27, %p4;
    selp.b64 %rd6, %rd27, %rd6, %p4;

    add.u32 %r7, %r1, %r3;
    mul.wide.u32 %rd9, %r7, 64;
    add.u64 %rd9, %rd1, %rd9;
    ld.global.v2.u64 {{%rd10, %rd11}}, [%rd9];
    ld.global.v2.u64 {{%rd12, %rd13}}, [%rd9+16];
    ld.global.v2.u64 {{%rd14, %rd15}}, [%rd9+32];
    ld.global.u64 %rd16, [%rd9+48];

    setp.ge.u64 %p1, %rd6, %rd12;
    setp.ge.u64 %p2, %rd8, %rd15;
    or.pred %p1, %p1, %p2;
    @%p1 bra DONE;

    mad.lo.u64 %rd17, %rd6, %rd11, %rd10;
    mad.lo.u64 %rd18, %rd8, %rd14, %rd13;
    cvta.to.global.u64 %rd17, %rd17;
    cvta.to.global.u64 %rd18, %rd18;
    cvt.u64.u32 %rd19, %r4;
    mul.lo.u64 %rd20, %rd19, %rd4;
    add.u64 %rd21, %rd20, %rd4;
    min.u64 %rd21, %rd21, %rd16;
    mul.wide.u32 %rd22, %r5, {w};
    add.u64 %rd23, %rd20, %rd22;
    mul.wide.u32 %rd24, %r6, {w};
LOOP:
    setp.ge.u64 %p3, %rd23, %rd21;
    @%p3 bra DONE;
    add.u64 %rd25, %rd17, %rd23;
    add.u64 %rd26, %rd18, %rd23;
    ld.global.{kind} {value}, [%rd25];
    st.global.{kind} [%rd26], {value};
    add.u64 %rd23, %rd23, %rd24;
    bra LOOP;
DONE:
    ret;
}}
"""


def kernel_name(width: int) -> str:
    return f"copy_blocks_{width}"


def ptx() -> str:
    """The module: one entry per access width."""
    head = ".version 7.0\n.target sm_70\n.address_size 64\n"
    body = []
    for w in WIDTHS:
        regs, kind, value = _ACCESS[w]
        body.append(_ENTRY.format(w=w, regs=regs, kind=kind, value=value))
    return head + "".join(body)
