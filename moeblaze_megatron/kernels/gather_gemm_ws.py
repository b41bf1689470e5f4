"""The gather GEMM's fused-epilogue launches on Hopper with the epilogue in warps of its own (Gluon).

``gather_gemm_kernel`` runs a tile's epilogue in the warps that multiplied it, so the tensor cores
idle while the saved pre-activations are read and the results written (benchmarks/notes/epilogues.md,
"What the fused epilogues cost"). Here one persistent program per multiprocessor runs two partitions
on different tiles at once:

- the main loop (8 warps, two warpgroups on one tile: fc1's 128 x 256, the Triton kernel's; dH's
  128 x 128): A's rows gathered by token with ``cp.async`` (each thread's copies arrive on an
  mbarrier; rows past the tile's expert read zeros), the weight's tile by TMA, STAGES - 1 steps
  ahead across tile boundaries, wgmma; at each tile's end the accumulator, rounded to the storage
  dtype, goes to the epilogue through one shared-memory buffer and the next tile starts;
- the epilogue (4 warps): the activation forward (fc1: pre and act(pre) stored) or backward (dH:
  d pre over pre, p * act(pre), the router-gradient partials) from that buffer, 16 columns at a
  time. dH's saved pre-activations come by TMA into shared memory a whole tile ahead (pointer
  loads from four warps kept too few in flight: its epilogue, not its main loop, set the pace).

The same k order and roundings as ``gather_gemm_kernel``, so every output but the router-gradient
partials (one per 128 columns, summed in another order) is bitwise the Triton kernel's.
``ws_takes`` says which launches it takes, ``ws_call`` builds one; the launchers choose it under
``SETTINGS.warp_specialize`` (``gather_gemm.gather_gemm_call``).

Gluon has no interpreter: this path runs on Hopper GPUs only, held to the Triton kernel and to
float64 by tests/gpu and compiled for sm_90a on the CPU by tests/scripts; the Triton kernel stays
the CPU-tested path and the fallback everywhere else.
"""

# No `from __future__ import annotations`: Gluon's aggregates check their fields' annotated types.
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

from .configs import DS_COLS, EPI_ACT_BWD, EPI_ACT_FWD, EPI_STORE  # EPI_STORE: a diagnostic here
from .activations import act, act_bwd  # Triton functions: Gluon calls them as they are

# The Triton 3.6 names of the TMA load and of the barrier across a partition's warps (3.8 calls
# them async_load and barrier).
_tma_load = getattr(tma, "async_copy_global_to_shared", None) or tma.async_load
_warps_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@aggregate
class _Tiles:
    """The persistent schedule every partition walks in the same order: this program's tiles of
    the row tiles (each inside one expert) x column tiles, grouped by GROUP_M row tiles."""

    offsets_ptr: gl.tensor
    E: gl.tensor
    m_tiles: gl.tensor
    n_tiles: gl.tensor
    BLOCK_M: gl.constexpr
    GROUP_M: gl.constexpr
    E_POW2: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, offsets_ptr, E, m_tiles, n_tiles, BLOCK_M, GROUP_M, E_POW2):
        self.offsets_ptr = offsets_ptr
        self.E = E
        self.m_tiles = m_tiles
        self.n_tiles = n_tiles
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.GROUP_M = gl.constexpr(GROUP_M)
        self.E_POW2 = gl.constexpr(E_POW2)

    @gluon.jit
    def create(offsets_ptr, E, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
               E_POW2: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        e_idx = gl.arange(0, E_POW2, layout=layout)
        lo = gl.load(offsets_ptr + e_idx, mask=e_idx < E, other=0)
        hi = gl.load(offsets_ptr + e_idx + 1, mask=e_idx < E, other=0)
        m_tiles = gl.sum((hi - lo + BLOCK_M - 1) // BLOCK_M, axis=0)
        return _Tiles(offsets_ptr, E, m_tiles, gl.cdiv(N, BLOCK_N), BLOCK_M, GROUP_M, E_POW2)

    @gluon.jit
    def count(self):
        """How many tiles this program runs."""
        total = self.m_tiles * self.n_tiles
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        return gl.maximum(total - pid + nprog - 1, 0) // nprog

    @gluon.jit
    def coords(self, i):
        """This program's i-th tile: (expert, the expert's first row, the tile's first row, the end
        of the expert's rows, the tile's column block)."""
        t = gl.program_id(0) + i * gl.num_programs(0)
        in_group = self.GROUP_M * self.n_tiles
        first_m = (t // in_group) * self.GROUP_M
        # (At least 1: a program asks for the tile after its last one too, which does not exist.)
        group_rows = gl.maximum(gl.minimum(self.m_tiles - first_m, self.GROUP_M), 1)
        pid_m = first_m + (t % in_group) % group_rows
        pid_n = (t % in_group) // group_rows
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        e_idx = gl.arange(0, self.E_POW2, layout=layout)
        lo = gl.load(self.offsets_ptr + e_idx, mask=e_idx < self.E, other=0)
        hi = gl.load(self.offsets_ptr + e_idx + 1, mask=e_idx < self.E, other=0)
        tiles = (hi - lo + self.BLOCK_M - 1) // self.BLOCK_M
        ends = gl.associative_scan(tiles, 0, _add)
        e = gl.sum((ends <= pid_m).to(gl.int32), axis=0)
        this = e_idx == e
        first_tile = gl.sum(gl.where(this, ends - tiles, 0), axis=0)
        row_lo = gl.sum(gl.where(this, lo, 0), axis=0)
        row_end = gl.sum(gl.where(this, hi, 0), axis=0)
        return e, row_lo, row_lo + (pid_m - first_tile) * self.BLOCK_M, row_end, pid_n


@gluon.jit
def _add(a, b):
    return a + b


@gluon.constexpr_function
def _rows_layout(bitwidth, cols, warps):
    """A [rows, cols] tile's layout: rows over the warps, columns in 16-byte vectors."""
    vec = 128 // bitwidth
    return gl.BlockedLayout([1, vec], [32 // (cols // vec), cols // vec], [warps, 1], [1, 0])


@aggregate
class _Shared:
    """The buffers and barriers the two partitions share."""

    a_bufs: gl.shared_memory_descriptor
    b_bufs: gl.shared_memory_descriptor
    a_ready: gl.shared_memory_descriptor
    b_ready: gl.shared_memory_descriptor
    acc_buf: gl.shared_memory_descriptor
    acc_ready: gl.shared_memory_descriptor
    acc_empty: gl.shared_memory_descriptor
    pre_bufs: gl.shared_memory_descriptor
    pre_ready: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, a_bufs, b_bufs, a_ready, b_ready, acc_buf, acc_ready, acc_empty, pre_bufs, pre_ready):
        self.a_bufs = a_bufs
        self.b_bufs = b_bufs
        self.a_ready = a_ready
        self.b_ready = b_ready
        self.acc_buf = acc_buf
        self.acc_ready = acc_ready
        self.acc_empty = acc_empty
        # dH's pre-activations, one [BLOCK_M, CHUNK] slot per chunk (gate's, then up's), each
        # chunk's pair arriving on its own barrier (the activation forward: unused stand-ins).
        self.pre_bufs = pre_bufs
        self.pre_ready = pre_ready


@aggregate
class _Problem:
    """The launch's tensors and sizes (pointers as the Triton kernel takes them)."""

    a_ptr: gl.tensor
    b_desc: tma.tensor_descriptor
    b2_desc: tma.tensor_descriptor
    pre_desc: tma.tensor_descriptor
    c_ptr: gl.tensor
    pre_ptr: gl.tensor
    probs_ptr: gl.tensor
    ds_ptr: gl.tensor
    token_idx_ptr: gl.tensor
    N: gl.tensor
    K: gl.tensor
    stride_am: gl.tensor
    stride_cm: gl.tensor
    stride_pm: gl.tensor
    stride_dsm: gl.tensor
    B_ROWS: gl.tensor
    UP_OFF: gl.tensor
    tiles: _Tiles
    EPILOGUE: gl.constexpr
    ACT: gl.constexpr
    GLU: gl.constexpr
    STORE_PRE: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    BLOCK_K: gl.constexpr
    OUT_N: gl.constexpr
    STAGES: gl.constexpr
    CHUNK: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, a_ptr, b_desc, b2_desc, pre_desc, c_ptr, pre_ptr, probs_ptr, ds_ptr, token_idx_ptr, N, K,
                 stride_am, stride_cm, stride_pm, stride_dsm, B_ROWS, UP_OFF, tiles, EPILOGUE, ACT, GLU, STORE_PRE,
                 BLOCK_M, BLOCK_N, BLOCK_K, OUT_N, STAGES, CHUNK):
        self.a_ptr = a_ptr
        self.b_desc = b_desc
        self.b2_desc = b2_desc
        self.pre_desc = pre_desc
        self.c_ptr = c_ptr
        self.pre_ptr = pre_ptr
        self.probs_ptr = probs_ptr
        self.ds_ptr = ds_ptr
        self.token_idx_ptr = token_idx_ptr
        self.N = N
        self.K = K
        self.stride_am = stride_am
        self.stride_cm = stride_cm
        self.stride_pm = stride_pm
        self.stride_dsm = stride_dsm
        self.B_ROWS = B_ROWS
        self.UP_OFF = UP_OFF
        self.tiles = tiles
        self.EPILOGUE = gl.constexpr(EPILOGUE)
        self.ACT = gl.constexpr(ACT)
        self.GLU = gl.constexpr(GLU)
        self.STORE_PRE = gl.constexpr(STORE_PRE)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.BLOCK_K = gl.constexpr(BLOCK_K)
        self.OUT_N = gl.constexpr(OUT_N)
        self.STAGES = gl.constexpr(STAGES)
        self.CHUNK = gl.constexpr(CHUNK)


@gluon.jit
def _tile_rows(p: _Problem, i, layout: gl.constexpr):
    """This program's i-th tile for the loads: (expert, column block, A's source row of each of
    its rows, which rows are the expert's: none past the program's last tile)."""
    e, row_lo, row0, row_end, pid_n = p.tiles.coords(i)
    rows = row0 + gl.arange(0, p.BLOCK_M, layout=gl.SliceLayout(1, layout))
    row_ok = (rows < row_end) & (i < p.tiles.count())
    src = gl.load(p.token_idx_ptr + rows, mask=row_ok, other=0).to(gl.int64)
    return e, pid_n, src, row_ok


@gluon.jit
def _issue(p: _Problem, s: _Shared, j, e, pid_n, src, row_ok, k, valid, layout: gl.constexpr):
    """Step j's loads into stage j % STAGES, where ``valid``: A's rows gathered by cp.async (each
    thread's copies arrive on a_ready when they land; rows past the expert read zeros), the
    weight's tile by TMA (b_ready counts its bytes). Predicated rather than branched: a branch
    around them would serialize the main loop's wgmma (ptxas C7518)."""
    stage = j % p.STAGES
    b_bar = s.b_ready.index(stage)
    b_buf = s.b_bufs.index(stage)
    if p.EPILOGUE == 1:
        # fc1: the weight's rows are the output columns, [BLOCK_N, BLOCK_K] tiles of [E * B_ROWS, K];
        # SwiGLU's gate rows (b_desc) and up rows (b2_desc, UP_OFF on) fill the tile's two halves.
        row = e * p.B_ROWS + pid_n * p.OUT_N
        if p.GLU:
            half: gl.constexpr = p.BLOCK_N // 2
            mbarrier.expect(b_bar, 2 * p.b_desc.block_type.nbytes, pred=valid)
            _tma_load(p.b_desc, [row, k], b_bar, b_buf.slice(0, half, dim=0), pred=valid)
            _tma_load(p.b2_desc, [row + p.UP_OFF, k], b_bar, b_buf.slice(half, half, dim=0), pred=valid)
        else:
            mbarrier.expect(b_bar, p.b_desc.block_type.nbytes, pred=valid)
            _tma_load(p.b_desc, [row, k], b_bar, b_buf, pred=valid)
    else:
        # dH: [BLOCK_K, BLOCK_N] tiles of the weight as [E * K, N].
        mbarrier.expect(b_bar, p.b_desc.block_type.nbytes, pred=valid)
        _tma_load(p.b_desc, [e * p.K + k, pid_n * p.BLOCK_N], b_bar, b_buf, pred=valid)
    ks = k + gl.arange(0, p.BLOCK_K, layout=gl.SliceLayout(0, layout))
    ptrs = p.a_ptr + src[:, None] * p.stride_am + ks[None, :]
    async_copy.async_copy_global_to_shared(s.a_bufs.index(stage), ptrs,
                                           (row_ok & valid)[:, None] & (ks < p.K)[None, :])
    # Past the last step this completes a phase nobody waits for.
    async_copy.mbarrier_arrive(s.a_ready.index(stage), increment_count=False)


@gluon.jit
def _mainloop(p: _Problem, s: _Shared):
    """Loads and main loops: STAGES - 1 k-steps' loads in flight ahead of the MMA, across tile
    boundaries (the next tile's rows are found at the start of each tile); after each tile's
    last step the accumulator, in the storage dtype, goes into acc_buf once the epilogue
    partition has read the previous tile."""
    BM: gl.constexpr = p.BLOCK_M
    BN: gl.constexpr = p.BLOCK_N
    BK: gl.constexpr = p.BLOCK_K
    S: gl.constexpr = p.STAGES
    WARPS: gl.constexpr = gl.num_warps()
    ld_layout: gl.constexpr = _rows_layout(p.a_ptr.dtype.element_ty.primitive_bitwidth, BK, WARPS)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, BN, 16])
    k_steps = gl.cdiv(p.K, BK)
    n_tiles = p.tiles.count()
    total = n_tiles * k_steps
    e, pid_n, src, row_ok = _tile_rows(p, 0, ld_layout)
    # The first S - 1 steps (the first tile's, or past it when it has fewer).
    for j in gl.static_range(S - 1):
        jt = j // k_steps
        e_j, pid_n_j, src_j, row_ok_j = _tile_rows(p, jt, ld_layout)
        _issue(p, s, j, e_j, pid_n_j, src_j, row_ok_j, (j % k_steps) * BK, j < total, ld_layout)
    it = 0
    for i in range(n_tiles):
        # The tile whose loads the last S - 1 steps of this one issue.
        e_next, pid_n_next, src_next, row_ok_next = _tile_rows(p, i + 1, ld_layout)
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
        # Two loops, so that no step selects between this tile's and the next one's rows: the
        # steps whose loads S - 1 ahead are still this tile's, then the last S - 1 steps, whose
        # loads are the next tile's first ones (none past the program's last tile).
        for kk in range(k_steps - (S - 1)):
            acc = _mma_step(p, s, it, kk, acc)
            _issue(p, s, it + S - 1, e, pid_n, src, row_ok, (kk + S - 1) * BK, it + S - 1 < total, ld_layout)
            it += 1
        for kk in range(k_steps - (S - 1), k_steps):
            acc = _mma_step(p, s, it, kk, acc)
            _issue(p, s, it + S - 1, e_next, pid_n_next, src_next, row_ok_next, (kk + S - 1 - k_steps) * BK,
                   it + S - 1 < total, ld_layout)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        e, pid_n, src, row_ok = e_next, pid_n_next, src_next, row_ok_next
        mbarrier.wait(s.acc_empty, (i & 1) ^ 1)
        # acc_buf holds the tile as BLOCK_N / CHUNK column chunks, which the epilogue indexes
        # in a loop (a shared-memory slice takes static bounds only).
        pieces = _split_columns(acc.to(p.c_ptr.dtype.element_ty), BN // p.CHUNK)
        for c in gl.static_range(BN // p.CHUNK):
            s.acc_buf.index(c).store(pieces[c])
        mbarrier.arrive(s.acc_ready)


@gluon.jit
def _mma_step(p: _Problem, s: _Shared, it, kk, acc):
    """Main-loop step ``it`` (the tile's ``kk``-th): wait for its stage's loads, multiply, and wait
    until at most this step's MMA is outstanding, so step it - 1's stage can take new loads."""
    stage = it % p.STAGES
    phase = (it // p.STAGES) & 1
    mbarrier.wait(s.a_ready.index(stage), phase)
    mbarrier.wait(s.b_ready.index(stage), phase)
    # A came through the generic proxy (cp.async); wgmma reads shared memory through the async one.
    fence_async_shared()
    b = s.b_bufs.index(stage)
    if p.EPILOGUE == 1:
        b = b.permute((1, 0))
    acc = warpgroup_mma(s.a_bufs.index(stage), b, acc, use_acc=kk > 0, is_async=True)
    return warpgroup_mma_wait(num_outstanding=1, deps=(acc,))


@gluon.jit
def _split_columns(x, PIECES: gl.constexpr):
    """``x`` [M, N] as a tuple of PIECES column blocks [M, N / PIECES], in order (PIECES a power of two)."""
    xs = (x,)
    for _ in gl.static_range(PIECES.bit_length() - 1):
        halves = ()
        for j in gl.static_range(len(xs)):
            y = xs[j]
            halves += y.reshape([y.shape[0], 2, y.shape[1] // 2]).permute((0, 2, 1)).split()
        xs = halves
    return xs


@gluon.jit
def _epilogue_rows(p: _Problem, i, layout: gl.constexpr):
    """The epilogue's view of this program's i-th tile: its rows (also as int64), which of them are
    the expert's, and its column block."""
    e, row_lo, row0, row_end, pid_n = p.tiles.coords(i)
    rows = row0 + gl.arange(0, p.BLOCK_M, layout=gl.SliceLayout(1, layout))
    return rows, rows < row_end, rows.to(gl.int64), pid_n


@gluon.jit
def _epilogue(p: _Problem, s: _Shared):
    if p.EPILOGUE == 1:
        _epilogue_fwd(p, s)
    elif p.EPILOGUE == 2:
        _epilogue_bwd(p, s)
    else:
        _epilogue_store(p, s)


@gluon.jit
def _epilogue_store(p: _Problem, s: _Shared):
    """EPILOGUE 0 (a diagnostic: the main loop's rate without an epilogue's work): each tile from
    acc_buf into c as it is."""
    CH: gl.constexpr = p.CHUNK
    layout: gl.constexpr = _rows_layout(p.c_ptr.dtype.element_ty.primitive_bitwidth, CH, gl.num_warps())
    cols_in = gl.arange(0, CH, layout=gl.SliceLayout(0, layout))
    for i in range(p.tiles.count()):
        rows, row_ok, r64, pid_n = _epilogue_rows(p, i, layout)
        mbarrier.wait(s.acc_ready, i & 1)
        for c in range(p.BLOCK_N // CH):
            cols = pid_n * p.BLOCK_N + c * CH + cols_in
            mask = row_ok[:, None] & (cols < p.N)[None, :]
            gl.store(p.c_ptr + r64[:, None] * p.stride_cm + cols[None, :], s.acc_buf.index(c).load(layout), mask=mask)
        mbarrier.arrive(s.acc_empty)


@gluon.jit
def _epilogue_fwd(p: _Problem, s: _Shared):
    """The activation forward of each tile, CHUNK columns at a time, from acc_buf (the
    pre-activations rounded to the storage dtype, which backward recomputes from): pre stored
    (gate, and up N columns on, for SwiGLU) where STORE_PRE, act(pre) (silu(gate) * up) into c."""
    CH: gl.constexpr = p.CHUNK
    NC: gl.constexpr = p.OUT_N // CH
    out_dtype: gl.constexpr = p.c_ptr.dtype.element_ty
    layout: gl.constexpr = _rows_layout(out_dtype.primitive_bitwidth, CH, gl.num_warps())
    cols_in = gl.arange(0, CH, layout=gl.SliceLayout(0, layout))
    for i in range(p.tiles.count()):
        rows, row_ok, r64, pid_n = _epilogue_rows(p, i, layout)
        mbarrier.wait(s.acc_ready, i & 1)
        for c in range(NC):
            cols = pid_n * p.OUT_N + c * CH + cols_in
            mask = row_ok[:, None] & (cols < p.N)[None, :]
            gate = s.acc_buf.index(c).load(layout)
            pre_ptrs = p.pre_ptr + r64[:, None] * p.stride_pm + cols[None, :]
            if p.STORE_PRE:
                gl.store(pre_ptrs, gate, mask=mask)
            if p.GLU:
                up = s.acc_buf.index(c + NC).load(layout)
                if p.STORE_PRE:
                    gl.store(pre_ptrs + p.N, up, mask=mask)
                h = act(gate.to(gl.float32), p.ACT) * up.to(gl.float32)
            else:
                h = act(gate.to(gl.float32), p.ACT)
            gl.store(p.c_ptr + r64[:, None] * p.stride_cm + cols[None, :], h.to(out_dtype), mask=mask)
        # Every chunk of the buffer is read: the main loop may hand over the next tile.
        mbarrier.arrive(s.acc_empty)


@gluon.jit
def _issue_pre(p: _Problem, s: _Shared, c: gl.constexpr, row0, col0, valid):
    """Chunk c of the saved pre-activations of the tile at (row0, col0) by TMA into chunk c's
    slots (gate's and, N columns on, up's for SwiGLU), arriving on pre_ready[c], where ``valid``.
    Rows past the tile's expert are another expert's (read, never written: the stores are
    masked) or past the tensor (zeros)."""
    CH: gl.constexpr = p.CHUNK
    NC: gl.constexpr = p.BLOCK_N // CH
    bar = s.pre_ready.index(c)
    if p.GLU:
        mbarrier.expect(bar, 2 * p.pre_desc.block_type.nbytes, pred=valid)
        _tma_load(p.pre_desc, [row0, col0 + c * CH], bar, s.pre_bufs.index(c), pred=valid)
        _tma_load(p.pre_desc, [row0, p.N + col0 + c * CH], bar, s.pre_bufs.index(NC + c), pred=valid)
    else:
        mbarrier.expect(bar, p.pre_desc.block_type.nbytes, pred=valid)
        _tma_load(p.pre_desc, [row0, col0 + c * CH], bar, s.pre_bufs.index(c), pred=valid)


@gluon.jit
def _epilogue_bwd(p: _Problem, s: _Shared):
    """The activation backward of each tile, CHUNK columns at a time, from acc_buf (dH rounded to
    the storage dtype) and the tile's pre-activations in pre_bufs: d pre over pre (d gate and,
    N columns on, d up for SwiGLU), p * act(pre) into c, and the rows' partial <dH, act(pre)> into
    ds (one per tile: BLOCK_N is DS_COLS). Each chunk's slots take the next tile's chunk as soon
    as every warp has read them, a whole tile's epilogue and main loop ahead of its use."""
    CH: gl.constexpr = p.CHUNK
    NC: gl.constexpr = p.BLOCK_N // CH
    out_dtype: gl.constexpr = p.c_ptr.dtype.element_ty
    layout: gl.constexpr = _rows_layout(out_dtype.primitive_bitwidth, CH, gl.num_warps())
    cols_in = gl.arange(0, CH, layout=gl.SliceLayout(0, layout))
    n_tiles = p.tiles.count()
    _, _, row0, row_end, pid_n = p.tiles.coords(0)
    for c in gl.static_range(NC):
        _issue_pre(p, s, c, row0, pid_n * p.BLOCK_N, n_tiles > 0)
    for i in range(n_tiles):
        _, _, row0_next, row_end_next, pid_n_next = p.tiles.coords(i + 1)
        rows = row0 + gl.arange(0, p.BLOCK_M, layout=gl.SliceLayout(1, layout))
        row_ok = rows < row_end
        r64 = rows.to(gl.int64)
        prob = gl.load(p.probs_ptr + rows, mask=row_ok, other=0.0).to(gl.float32)
        ds = gl.zeros([p.BLOCK_M], dtype=gl.float32, layout=gl.SliceLayout(1, layout))
        col0 = pid_n * p.BLOCK_N
        mbarrier.wait(s.acc_ready, i & 1)
        for c in gl.static_range(NC):
            mbarrier.wait(s.pre_ready.index(c), i & 1)
            g = s.pre_bufs.index(c).load(layout).to(gl.float32)
            if p.GLU:
                up = s.pre_bufs.index(NC + c).load(layout).to(gl.float32)
            else:
                up = g
            dh_raw = s.acc_buf.index(c).load(layout).to(gl.float32)
            # Every warp's reads of the chunk's slots done (and ordered before the async proxy's
            # writes): the next tile's chunk may come into them.
            fence_async_shared()
            _warps_barrier()
            _issue_pre(p, s, c, row0_next, pid_n_next * p.BLOCK_N, i + 1 < n_tiles)
            cols = col0 + c * CH + cols_in
            mask = row_ok[:, None] & (cols < p.N)[None, :]
            pre_ptrs = p.pre_ptr + r64[:, None] * p.stride_pm + cols[None, :]
            h, d_pre, d_up = act_bwd(dh_raw * prob[:, None], g, up, p.ACT, p.GLU)
            if p.GLU:
                gl.store(pre_ptrs + p.N, d_up.to(out_dtype), mask=mask)
            gl.store(pre_ptrs, d_pre.to(out_dtype), mask=mask)
            gl.store(p.c_ptr + r64[:, None] * p.stride_cm + cols[None, :], (h * prob[:, None]).to(out_dtype),
                     mask=mask)
            ds += gl.sum(gl.where(mask, dh_raw * h, 0.0), axis=1)
        # Every chunk of the buffer is read: the main loop may hand over the next tile.
        mbarrier.arrive(s.acc_empty)
        gl.store(p.ds_ptr + r64 * p.stride_dsm + pid_n, ds, mask=row_ok)
        row0, row_end, pid_n = row0_next, row_end_next, pid_n_next


@gluon.jit
def gather_gemm_ws_kernel(
    a_ptr, b_desc, b2_desc, pre_desc, c_ptr, pre_ptr, probs_ptr, ds_ptr, token_idx_ptr, offsets_ptr,
    N, K, E, B_ROWS, UP_OFF, stride_am, stride_cm, stride_pm, stride_dsm,
    EPILOGUE: gl.constexpr, ACT: gl.constexpr, GLU: gl.constexpr, STORE_PRE: gl.constexpr,
    E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, STAGES: gl.constexpr, CHUNK: gl.constexpr, EPILOGUE_WARPS: gl.constexpr,
    EPILOGUE_REGS: gl.constexpr,
):
    """C = A[src] @ B[e] per row tile with ``gather_gemm_kernel``'s fused epilogues, one program per
    multiprocessor (K a multiple of BLOCK_K and at least (STAGES - 1) * BLOCK_K).

    EPILOGUE 1, the activation forward (fc1): B is [E * B_ROWS, K] (the weight's rows are the
    output columns, as nn.Linear keeps them); for SwiGLU b_desc's rows are the gates and b2_desc's,
    UP_OFF rows on, the ups ([gate | up] stacked: both over one tensor; torchtitan's w1 and w3:
    one each), and each 128 x 256 tile is 128 gate and 128 up columns; pre_desc unused.
    EPILOGUE 2, the activation backward (dH): B is [E * K, N], b2_desc unused, pre_desc the saved
    pre-activations ([rows, 2N] for SwiGLU, else [rows, N]) in [BLOCK_M, CHUNK] boxes."""
    dtype: gl.constexpr = b_desc.dtype
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    if EPILOGUE == 1:
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], b_layout)
    else:
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
    acc_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    acc_buf = gl.allocate_shared_memory(dtype, [BLOCK_N // CHUNK, BLOCK_M, CHUNK], acc_layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    acc_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    acc_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    if EPILOGUE == 2:
        chunks: gl.constexpr = BLOCK_N // CHUNK
        pre_bufs = gl.allocate_shared_memory(dtype, [2 * chunks if GLU else chunks, BLOCK_M, CHUNK], pre_desc.layout)
        pre_ready = gl.allocate_shared_memory(gl.int64, [chunks, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(chunks):
            mbarrier.init(pre_ready.index(c), count=1)
    else:
        pre_bufs, pre_ready = acc_buf, acc_ready
    for i in gl.static_range(STAGES):
        # Each main-loop thread's cp.async arrival counts once (noinc).
        mbarrier.init(a_ready.index(i), count=gl.num_warps() * 32)
        mbarrier.init(b_ready.index(i), count=1)
    mbarrier.init(acc_ready, count=1)
    mbarrier.init(acc_empty, count=1)

    # Integers Triton specialized to constants (1) become tensors again: the aggregates hold tensors.
    N, K, E = gl.to_tensor(N), gl.to_tensor(K), gl.to_tensor(E)
    B_ROWS, UP_OFF = gl.to_tensor(B_ROWS), gl.to_tensor(UP_OFF)
    stride_am, stride_cm = gl.to_tensor(stride_am), gl.to_tensor(stride_cm)
    stride_pm, stride_dsm = gl.to_tensor(stride_pm), gl.to_tensor(stride_dsm)
    # The output columns one tile covers: the SwiGLU forward's tile is half gate, half up.
    OUT_N: gl.constexpr = BLOCK_N // 2 if EPILOGUE == 1 and GLU else BLOCK_N
    tiles = _Tiles.create(offsets_ptr, E, N, BLOCK_M, OUT_N, GROUP_M, E_POW2)
    p = _Problem(a_ptr, b_desc, b2_desc, pre_desc, c_ptr, pre_ptr, probs_ptr, ds_ptr, token_idx_ptr, N, K, stride_am,
                 stride_cm, stride_pm, stride_dsm, B_ROWS, UP_OFF, tiles, EPILOGUE, ACT, GLU, STORE_PRE, BLOCK_M,
                 BLOCK_N, BLOCK_K, OUT_N, STAGES, CHUNK)
    s = _Shared(a_bufs, b_bufs, a_ready, b_ready, acc_buf, acc_ready, acc_empty, pre_bufs, pre_ready)
    gl.warp_specialize([
        (_mainloop, (p, s)),
        (_epilogue, (p, s)),
    ], [EPILOGUE_WARPS], [EPILOGUE_REGS])


# Two warpgroups of main loop on each tile. fc1: 128 x 256 (the Triton kernel's tile; for SwiGLU 128
# gate and 128 up columns), three 48 KB stages beside the 64 KB tile buffer (208 KB). dH: 128 x 128
# (DS_COLS: the router-gradient partials' span), four 32 KB stages, the 32 KB tile buffer and the
# tile's pre-activations by TMA, 64 KB for SwiGLU (224 KB of the 227 KB a program may have; a
# 128 x 256 tile leaves no room for them, and two stages cost too much: benchmarks/notes/kernels.md,
# "The Gluon kernel's main loop: two loops per tile, BLOCK_K 64 at three stages"). 4 epilogue warps
# each: dH's epilogue waits on its main loop more than half the time, and 8 warps (16 x 128
# registers) were slower (benchmarks/notes/kernels.md, "The warp-specialized dH stays off by default").
WS_TILES = {
    EPI_ACT_FWD: dict(BLOCK_M=128, BLOCK_N=2 * DS_COLS, BLOCK_K=64, GROUP_M=8, STAGES=3, CHUNK=16, EPILOGUE_WARPS=4),
    EPI_ACT_BWD: dict(BLOCK_M=128, BLOCK_N=DS_COLS, BLOCK_K=64, GROUP_M=8, STAGES=4, CHUNK=16, EPILOGUE_WARPS=4),
}
WS_WARPS = 8  # the main loop's


def ws_registers(tile) -> int:
    """Registers a thread of a launch with this tile: the multiprocessor's 64K over its warps, in
    whole 8s (12 warps: 168, which fc1's 128 x 256 accumulator needs; 16 warps: 128)."""
    return 65536 // (32 * (WS_WARPS + tile["EPILOGUE_WARPS"])) // 8 * 8


WS_DTYPES = ("torch.bfloat16", "torch.float16")


def ws_tile(epilogue) -> dict:
    """The tile of a launch: dH's for the activation backward and for EPI_STORE (a diagnostic of
    dH's main loop), fc1's for the activation forward."""
    return WS_TILES[EPI_ACT_FWD if epilogue == EPI_ACT_FWD else EPI_ACT_BWD]


def _smem_layout(block, dtype):
    from triton.experimental.gluon.language import NVMMASharedLayout

    return NVMMASharedLayout.get_default_for(block, gl.bfloat16 if str(dtype) == "torch.bfloat16" else gl.float16)


def _min_k(epilogue) -> int:
    """The least K a launch takes: its loads run STAGES - 1 steps of BLOCK_K ahead."""
    tile = ws_tile(epilogue)
    return (tile["STAGES"] - 1) * tile["BLOCK_K"]


WS_REQUIREMENTS = (
    f"the warp-specialized fused epilogues need a Hopper GPU (compute capability 9.x), A gathered by token with K "
    f"a multiple of {WS_TILES[EPI_ACT_FWD]['BLOCK_K']} and at least {_min_k(EPI_ACT_FWD)} (the activation forward) "
    f"or {_min_k(EPI_ACT_BWD)} (the backward), float16 or bfloat16 throughout, and the weight contiguous: "
    f"[E, out, K] read transposed (or a gate/up pair of them) for the activation forward, [E, K, N] as it is for "
    f"the backward, whose saved pre-activations need unit column stride and 16-byte aligned rows")


def on_hopper(capability) -> bool:
    """Whether a GPU of this compute capability runs the kernel (Hopper's wgmma: 9.x only)."""
    return capability is not None and capability[0] == 9


def ws_takes(a, weight, out, pre, epilogue, transpose_weight, capability) -> bool:
    """Whether ``gather_gemm_ws_kernel`` takes a fused-epilogue launch: a Hopper GPU (``capability``
    (9, x)), float16 or bfloat16 throughout, A's rows in 16-byte aligned vectors over K (a multiple
    of BLOCK_K, at least (STAGES - 1) * BLOCK_K: the loads run that far into the next tile), and
    the weight contiguous: [E, out, K] read transposed for the activation forward (a (gate, up)
    pair of them for SwiGLU too), [E, K, N] as it is for the activation backward, whose saved
    pre-activations come by TMA (unit column stride, 16-byte aligned start and rows)."""
    if not on_hopper(capability) or transpose_weight != (epilogue == EPI_ACT_FWD):
        return False
    weights = weight if isinstance(weight, tuple) else (weight,)
    tensors = (a, out, *weights) if pre is None else (a, out, pre, *weights)
    if not all(str(t.dtype) in WS_DTYPES and t.dtype == a.dtype for t in tensors):
        return False
    k_dim = a.shape[1]
    size = a.element_size()
    if epilogue == EPI_ACT_BWD and not (pre is not None and pre.stride(1) == 1 and (pre.stride(0) * size) % 16 == 0
                                        and pre.data_ptr() % 16 == 0):
        return False
    return (k_dim % ws_tile(epilogue)["BLOCK_K"] == 0 and k_dim >= _min_k(epilogue) and a.stride(1) == 1
            and (a.stride(0) * size) % 16 == 0 and a.data_ptr() % 16 == 0
            and all(w.is_contiguous() and w.data_ptr() % 16 == 0 and (w.shape[2] * size) % 16 == 0
                    and w.shape[1 if epilogue == EPI_ACT_BWD else 2] == k_dim for w in weights))


def ws_call(a, weight, out, plan, *, epilogue, act_id, glu, pre, n, sm_count, store_pre=True, probs_sorted=None,
            ds_partial=None):
    """The ``KernelCall`` of ``gather_gemm_ws_kernel`` for ``gather_gemm``'s fused epilogues (the
    arguments are ``gather_gemm_call``'s; ``ws_takes`` says which it takes): the activation forward
    (``out`` = act(pre), ``pre`` stored where ``store_pre``) or backward (``out`` = p * act(pre),
    ``pre`` <- d pre, ``ds_partial`` <- the router-gradient partials)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .calls import KernelCall
    from .launch import cdiv, next_pow2

    tile = ws_tile(epilogue)
    bm, bn, bk = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    rows_total = plan.expert_token_indices.shape[0]
    num_experts = plan.num_experts
    if epilogue == EPI_ACT_FWD:
        # The output columns are the weight's rows: [BLOCK_N, BLOCK_K] tiles, half of them each
        # from the gate and up rows for SwiGLU.
        halves = weight if isinstance(weight, tuple) else (weight,)
        out_n = bn // 2 if glu else bn
        descs = [TensorDescriptor.from_tensor(w.view(num_experts * w.shape[1], w.shape[2]), [out_n, bk],
                                              _smem_layout([out_n, bk], w.dtype)) for w in halves]
        b_desc, b2_desc = descs[0], descs[-1]
        b_rows = halves[0].shape[1]
        up_off = n if glu and len(halves) == 1 else 0
        pre_desc = b_desc  # unused
    else:
        if epilogue == EPI_ACT_BWD and ds_partial.shape[1] < cdiv(n, bn):
            raise ValueError(f"ws_call: ds_partial must have at least {cdiv(n, bn)} columns (one per {bn}-column "
                             f"tile of n={n}), got {ds_partial.shape[1]}")
        k_dim = weight.shape[1]
        b_desc = TensorDescriptor.from_tensor(weight.view(num_experts * k_dim, weight.shape[2]), [bk, bn],
                                              _smem_layout([bk, bn], weight.dtype))
        b2_desc, b_rows, up_off, out_n = b_desc, k_dim, 0, bn
        pre_desc = b_desc
        if epilogue == EPI_ACT_BWD:
            box = [bm, tile["CHUNK"]]
            # A TMA descriptor takes no empty dimension; with no rows no tile runs and nothing is read.
            rows_pre = pre if pre.shape[0] else pre.new_zeros(1, pre.shape[1])
            pre_desc = TensorDescriptor.from_tensor(rows_pre, box, _smem_layout(box, pre.dtype))
    tiles = (cdiv(rows_total, bm) + num_experts) * cdiv(n, out_n)
    args = (a, b_desc, b2_desc, pre_desc, out, pre if pre is not None else out,
            probs_sorted if probs_sorted is not None else out, ds_partial if ds_partial is not None else out,
            plan.expert_token_indices, plan.expert_token_offsets, n, a.shape[1], num_experts, b_rows, up_off,
            a.stride(0), out.stride(0), pre.stride(0) if pre is not None else 0,
            ds_partial.stride(0) if ds_partial is not None else 0)
    regs = ws_registers(tile)
    constexprs = dict(EPILOGUE=epilogue, ACT=act_id, GLU=glu, STORE_PRE=store_pre and pre is not None,
                      E_POW2=max(next_pow2(num_experts + 1), 16), **tile, EPILOGUE_REGS=regs, num_warps=WS_WARPS,
                      maxnreg=regs)
    return KernelCall(gather_gemm_ws_kernel, (max(1, min(tiles, sm_count)),), args, constexprs)
