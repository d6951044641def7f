"""Least-cost assignment on the device: scipy's linear_sum_assignment, one Triton program per problem, no host sync.

Each program solves one problem of ``rows <= cols`` by scipy's algorithm (Crouse's shortest augmenting path, as in
scipy/optimize/rectangular_lsap), step for step: costs read as float32 and summed in float64 in scipy's order, the
columns scanned in the order of scipy's list of remaining columns (filled in reverse, the chosen one replaced by the
last), ties broken as scipy breaks them (the least, preferring a column no row holds yet). So it returns scipy's
pairs, ties included, and the training step's matching needs no copy of the costs to the host, nor the GPU a wait
for the host's solve.

A problem is a strided view of a flat cost tensor, so that one launch solves every image of every decoder layer,
each image's (targets, queries) block read as it is or transposed, its targets repeated by wrapping the target
index (hybrid matching's copies): row i's cost for column j is

    cost[base + (i % row_period) * row_stride + (j % col_period) * col_stride]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A problem's description: one row of int64 numbers, in this order.
PROBLEM_FIELDS = ("base", "rows", "cols", "row_period", "row_stride", "col_period", "col_stride")


@triton.jit
def _assignment_kernel(
    cost_ptr,  # flat float32 costs
    problem_ptr,  # (P, 7) int64: PROBLEM_FIELDS
    col4row_ptr,  # (P, BLOCK_R) int32, -1 on entry: each row's column on exit
    u_ptr,  # (P, BLOCK_R) float64 scratch, 0 on entry: the rows' dual values
    visited_ptr,  # (P, BLOCK_R) int32 scratch: the rows the current path search reached
    shortest_ptr,  # (P, BLOCK_C) float64 scratch: the search's path costs, for the rows' dual update
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    p = tl.program_id(0)
    problem = problem_ptr + p * 7
    base = tl.load(problem)
    nr = tl.load(problem + 1).to(tl.int32)
    nc = tl.load(problem + 2).to(tl.int32)
    row_period = tl.load(problem + 3)
    row_stride = tl.load(problem + 4)
    col_period = tl.load(problem + 5)
    col_stride = tl.load(problem + 6)
    col4row = col4row_ptr + p * BLOCK_R
    u = u_ptr + p * BLOCK_R
    visited = visited_ptr + p * BLOCK_R
    shortest_saved = shortest_ptr + p * BLOCK_C

    rows = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    in_rows = rows < nr
    in_cols = cols < nc
    col_offsets = (cols.to(tl.int64) % col_period) * col_stride
    v = tl.zeros([BLOCK_C], dtype=tl.float64)
    row4col = tl.full([BLOCK_C], -1, dtype=tl.int32)
    path = tl.full([BLOCK_C], -1, dtype=tl.int32)

    for cur in range(0, nr):
        tl.store(visited + rows, 0, mask=in_rows)
        tl.debug_barrier()
        shortest = tl.full([BLOCK_C], float("inf"), dtype=tl.float64)
        scanned = cols >= nc
        # scipy's list of the columns not yet scanned, as each column's place in it: filled in reverse.
        position = nc - 1 - cols
        remaining = nc
        min_val = tl.full([], 0.0, dtype=tl.float64)
        i = cur
        sink = cur * 0 - 1
        while sink < 0:
            tl.store(visited + i, 1)
            u_i = tl.load(u + i)
            row_offset = (i.to(tl.int64) % row_period) * row_stride
            cost = tl.load(cost_ptr + base + row_offset + col_offsets, mask=in_cols, other=0.0).to(tl.float64)
            reduced = min_val + cost - u_i - v
            better = (~scanned) & (reduced < shortest)
            path = tl.where(better, i, path)
            shortest = tl.where(better, reduced, shortest)
            lowest = tl.min(tl.where(scanned, float("inf"), shortest), axis=0)
            # scipy keeps the first least column in its list, or the last of them that no row holds.
            tied = (~scanned) & (shortest == lowest)
            last_free = tl.max(tl.where(tied & (row4col < 0), position, -1), axis=0)
            first_tied = tl.min(tl.where(tied, position, BLOCK_C), axis=0)
            chosen = tl.where(last_free >= 0, last_free, first_tied)
            is_chosen = (~scanned) & (position == chosen)
            j = tl.sum(tl.where(is_chosen, cols, 0), axis=0)
            holder = tl.sum(tl.where(is_chosen, row4col, 0), axis=0)
            min_val = lowest
            scanned = scanned | is_chosen
            remaining -= 1
            # The list's last column takes the chosen one's place.
            position = tl.where((~scanned) & (position == remaining), chosen, position)
            sink = tl.where(holder < 0, j, -1)
            i = tl.where(holder < 0, i, holder)

        # The dual values, as scipy updates them.
        tl.store(shortest_saved + cols, shortest, mask=in_cols)
        tl.debug_barrier()
        reached = (tl.load(visited + rows, mask=in_rows, other=0) > 0) & (rows != cur)
        held = tl.load(col4row + rows, mask=in_rows, other=0)
        path_cost = tl.load(shortest_saved + held, mask=reached, other=0.0)
        u_rows = tl.load(u + rows, mask=in_rows, other=0.0)
        u_rows = tl.where(rows == cur, u_rows + min_val, u_rows)
        u_rows = tl.where(reached, u_rows + (min_val - path_cost), u_rows)
        tl.store(u + rows, u_rows, mask=in_rows)
        v = tl.where(scanned & in_cols, v - (min_val - shortest), v)
        tl.debug_barrier()

        # Augment along the path from the sink back to the current row.
        j = sink
        i = cur * 0 - 1
        while i != cur:
            i = tl.sum(tl.where(cols == j, path, 0), axis=0)
            row4col = tl.where(cols == j, i, row4col)
            previous = tl.load(col4row + i)
            tl.debug_barrier()
            tl.store(col4row + i, j)
            tl.debug_barrier()
            j = previous


def solve(costs: torch.Tensor, problems: torch.Tensor, *, max_rows: int, max_cols: int) -> torch.Tensor:
    """Each problem's least-cost assignment: (P, R) int32, row i's column (-1 past the problem's rows), R >= max_rows.

    costs: a flat float32 tensor of finite values (checking them would read them back; where scipy refuses a
    non-finite cost, this returns some assignment: the matcher replaces them first). problems: (P, 7) int64 on the
    costs' device, each row PROBLEM_FIELDS with rows <= cols; max_rows and max_cols: their largest rows and cols (host
    ints, which choose the kernel's block).
    """
    if costs.dtype != torch.float32 or costs.dim() != 1:
        got = f"{costs.dtype} {tuple(costs.shape)}"
        raise ValueError(f"assignment.solve: costs must be a flat float32 tensor, got {got}")
    if problems.dtype != torch.int64 or problems.shape[1:] != (len(PROBLEM_FIELDS),):
        got = f"{problems.dtype} {tuple(problems.shape)}"
        raise ValueError(f"assignment.solve: problems must be (P, 7) int64, got {got}")
    if max_rows > max_cols:
        raise ValueError(f"assignment.solve: each problem needs rows <= cols, got max_rows {max_rows} > {max_cols}")
    block_r = triton.next_power_of_2(max(max_rows, 1))
    block_c = triton.next_power_of_2(max(max_cols, 16))
    count = problems.shape[0]
    device = costs.device
    col4row = torch.full((count, block_r), -1, dtype=torch.int32, device=device)
    if count == 0 or max_rows == 0:
        return col4row
    u = torch.zeros((count, block_r), dtype=torch.float64, device=device)
    visited = torch.zeros((count, block_r), dtype=torch.int32, device=device)
    shortest = torch.empty((count, block_c), dtype=torch.float64, device=device)
    _assignment_kernel[(count,)](
        costs,
        problems,
        col4row,
        u,
        visited,
        shortest,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=4 if block_c <= 512 else 8 if block_c <= 2048 else 16,
    )
    return col4row
