"""The landing copy kernel, as PTX the CUDA driver compiles when a device is first used
(no toolkit, no torch, no Triton in the daemon: docs/gpu.md).

``copy_blocks_<W>`` copies, for pair ``x`` and entry ``first + y`` of a ``CopyPlan``
table (``state/landing.py``), the bytes ``[z * chunk, min((z + 1) * chunk, nbytes))`` of
one block, ``W`` bytes per access (W in 16, 8, 4, 2, 1: the plan's ``width``). With slot
``s = slot_base + x`` and ``m = map[s]``: landing (``mode`` 0) copies source block ``s``
(a landing slot) to destination block ``m`` (the worker's); staging (``mode`` 1) copies
source block ``m`` (the worker's) to destination block ``s`` (a staging slot); a pair copy
(``mode`` 2, P's copy into a same-host D's KV) copies source block ``m & 0xffffffff`` to
destination block ``m >> 32``. A block out of the entry's range copies nothing (the host
checks pairs before a launch; this is the second line).

Parameters, in order: ``table`` (u64 address), ``map`` (u64 address of the int64
slot -> block map of the group, or of the pairs), ``slot_base`` (u64), ``first`` (u32),
``chunk`` (u64), ``mode`` (u32).

Each thread moves ``W`` bytes every ``THREADS * W``: four such accesses at a time (four
loads in flight, then four stores) while four fit in the chunk, then one at a time.
"""

from __future__ import annotations

WIDTHS = (16, 8, 4, 2, 1)
LANDING, STAGING, PAIRS = 0, 1, 2  # the kernel's ``mode``
THREADS = 256
CHUNK = 64 << 10  # bytes of one entry one thread block copies

_ACCESS = {  # width -> (registers for four values, load/store type, the four value operands)
    16: (".reg .b32 %v<16>;", "v4.u32", tuple("{" + ", ".join(f"%v{4 * i + j}" for j in range(4)) + "}"
                                              for i in range(4))),
    8: (".reg .b64 %v<4>;", "u64", ("%v0", "%v1", "%v2", "%v3")),
    4: (".reg .b32 %v<4>;", "u32", ("%v0", "%v1", "%v2", "%v3")),
    2: (".reg .b16 %v<4>;", "u16", ("%v0", "%v1", "%v2", "%v3")),
    1: (".reg .b16 %v<4>;", "u8", ("%v0", "%v1", "%v2", "%v3")),
}

_ENTRY = """
.visible .entry copy_blocks_{w}(
    .param .u64 p_table, .param .u64 p_map, .param .u64 p_slot_base,
    .param .u32 p_first, .param .u64 p_chunk, .param .u32 p_mode)
{{
    .reg .pred %p<6>;
    .reg .b32 %r<9>;
    .reg .b64 %rd<40>;
    {regs}

    ld.param.u64 %rd1, [p_table];
    ld.param.u64 %rd2, [p_map];
    ld.param.u64 %rd3, [p_slot_base];
    ld.param.u32 %r1, [p_first];
    ld.param.u64 %rd4, [p_chunk];
    ld.param.u32 %r8, [p_mode];
    setp.eq.u32 %p4, %r8, 1;
    setp.eq.u32 %p5, %r8, 2;
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
    and.b64 %rd28, %rd27, 4294967295;
    shr.u64 %rd29, %rd27, 32;
    selp.b64 %rd6, %rd28, %rd6, %p5;
    selp.b64 %rd8, %rd29, %rd8, %p5;

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
    mul.lo.u64 %rd30, %rd24, 3;
    shl.b64 %rd31, %rd24, 2;
QUAD:
    add.u64 %rd32, %rd23, %rd30;
    setp.ge.u64 %p3, %rd32, %rd21;
    @%p3 bra LOOP;
    add.u64 %rd25, %rd17, %rd23;
    add.u64 %rd26, %rd18, %rd23;
    add.u64 %rd33, %rd25, %rd24;
    add.u64 %rd34, %rd26, %rd24;
    add.u64 %rd35, %rd33, %rd24;
    add.u64 %rd36, %rd34, %rd24;
    add.u64 %rd37, %rd35, %rd24;
    add.u64 %rd38, %rd36, %rd24;
    ld.global.{kind} {v0}, [%rd25];
    ld.global.{kind} {v1}, [%rd33];
    ld.global.{kind} {v2}, [%rd35];
    ld.global.{kind} {v3}, [%rd37];
    st.global.{kind} [%rd26], {v0};
    st.global.{kind} [%rd34], {v1};
    st.global.{kind} [%rd36], {v2};
    st.global.{kind} [%rd38], {v3};
    add.u64 %rd23, %rd23, %rd31;
    bra QUAD;
LOOP:
    setp.ge.u64 %p3, %rd23, %rd21;
    @%p3 bra DONE;
    add.u64 %rd25, %rd17, %rd23;
    add.u64 %rd26, %rd18, %rd23;
    ld.global.{kind} {v0}, [%rd25];
    st.global.{kind} [%rd26], {v0};
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
        regs, kind, values = _ACCESS[w]
        body.append(_ENTRY.format(w=w, regs=regs, kind=kind, v0=values[0], v1=values[1], v2=values[2],
                                  v3=values[3]))
    return head + "".join(body)
