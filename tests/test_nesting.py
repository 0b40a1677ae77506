"""The vectorised nesting agrees with a brute-force innermost-enclosing search on random call stacks."""

import numpy as np

from conftest import trace_path

from plasmient_trace.sources.kineto import read_kineto
from plasmient_trace.stitch.nesting import innermost_enclosing, innermost_enclosing_points, tree_depth, tree_root


def _call_stacks(rng, groups=3, width=1000):
    out = []

    def gen(s, e, depth):
        if depth > 4 or e - s < 4:
            return
        t = s
        while t < e - 2:
            a = t + rng.integers(0, 3)
            b = min(e, a + rng.integers(1, (e - s) // 2 + 2))
            if b <= a:
                break
            out.append((g, a, b))
            gen(a, b, depth + 1)
            t = b

    for g in range(groups):
        gen(0, width, 0)
    arr = np.array(out)
    return arr[:, 0], arr[:, 1], arr[:, 2]


def _shortest(cands, s, e):
    return min(e[j] - s[j] for j in cands) if cands else None


def test_innermost_enclosing_matches_brute_force():
    rng = np.random.default_rng(1)
    g, s, e = _call_stacks(rng)
    pg, pt = rng.integers(0, 3, 400), rng.integers(0, 1000, 400)
    iv_parent, pt_parent = innermost_enclosing(g, s, e, pg, pt)
    for i in range(len(s)):
        cands = [j for j in range(len(s)) if j != i and g[j] == g[i] and s[j] <= s[i] and e[i] <= e[j]
                 and not (s[j] == s[i] and e[j] == e[i] and j > i)]
        want = _shortest(cands, s, e)
        got = None if iv_parent[i] < 0 else e[iv_parent[i]] - s[iv_parent[i]]
        assert got == want, i
    for i in range(len(pt)):
        cands = [j for j in range(len(s)) if g[j] == pg[i] and s[j] <= pt[i] < e[j]]
        want = _shortest(cands, s, e)
        got = None if pt_parent[i] < 0 else e[pt_parent[i]] - s[pt_parent[i]]
        assert got == want, i


def test_a_few_points_among_many_intervals_get_the_brute_force_answer_from_the_intervals_around_them():
    rng = np.random.default_rng(2)
    g, s, e = _call_stacks(rng, groups=4, width=4000)
    pg, pt = rng.integers(0, 5, 60), rng.integers(-5, 4005, 60)  # group 4 has no intervals
    assert len(pt) * 8 <= len(s)  # few enough points for the filtered path
    got = innermost_enclosing_points(g, s, e, pg, pt)
    assert np.array_equal(got, innermost_enclosing(g, s, e, pg, pt)[1])
    for i in range(len(pt)):
        cands = [j for j in range(len(s)) if g[j] == pg[i] and s[j] <= pt[i] < e[j]]
        want = _shortest(cands, s, e)
        assert (None if got[i] < 0 else e[got[i]] - s[got[i]]) == want, i


def test_points_on_a_real_trace_get_the_same_ops_as_the_whole_nesting_gives():
    # launches among a real trace's ops, one point in 30: the answer the join used to get from nesting every op
    rs = read_kineto(trace_path("v100/resnet50_training.json.gz"))
    ops, launches = rs.ops, rs.launches
    thread = lambda t: t.column("pid").to_numpy() * (1 << 32) + (t.column("tid").to_numpy() & 0xFFFFFFFF)  # noqa: E731
    o_start, o_end = ops.column("start_ns").to_numpy(), ops.column("end_ns").to_numpy()
    pick = np.arange(0, launches.num_rows, 30)
    l_thread, l_start = thread(launches)[pick], launches.column("start_ns").to_numpy()[pick]
    want = innermost_enclosing(thread(ops), o_start, o_end, l_thread, l_start)[1]
    got = innermost_enclosing_points(thread(ops), o_start, o_end, l_thread, l_start)
    assert (want >= 0).mean() > 0.9 and np.array_equal(got, want)


def test_tree_depth_and_root():
    parent = np.array([-1, 0, 0, 1, 3, -1, 5])
    assert tree_depth(parent).tolist() == [0, 1, 1, 2, 3, 0, 1]
    assert tree_root(parent).tolist() == [0, 0, 0, 0, 0, 5, 5]


def _walk_depth_and_root(parent):
    """Oracle: follow each node's parent pointers one at a time."""
    depth, root = [], []
    for i in range(len(parent)):
        d, cur = 0, i
        while parent[cur] >= 0:
            cur, d = parent[cur], d + 1
        depth.append(d)
        root.append(cur)
    return depth, root


def test_tree_depth_and_root_match_a_pointer_walk_on_random_forests():
    rng = np.random.default_rng(7)
    for n in (1, 2, 50, 3000):
        # parent index below the node's own: always a forest, roots where the draw is -1
        parent = np.array([rng.integers(-1, i) if i else -1 for i in range(n)])
        depth, root = _walk_depth_and_root(parent)
        assert tree_depth(parent).tolist() == depth
        assert tree_root(parent).tolist() == root


def test_100k_identical_intervals_nest_as_one_chain_in_file_order():
    # A hostile trace: 100,000 copies of the same range on one thread. They nest like a call stack
    # (ties: the earlier event is the parent), so the chain is 100,000 deep; the old per-level loops
    # were quadratic in that depth.
    n = 100_000
    parent, _ = innermost_enclosing(np.zeros(n, np.int64), np.full(n, 1_000), np.full(n, 2_000))
    assert parent[0] == -1
    assert np.array_equal(parent[1:], np.arange(n - 1))
    assert np.array_equal(tree_depth(parent), np.arange(n))
    assert not tree_root(parent).any()


def test_deep_staircase_with_points_finds_the_innermost_interval():
    # Strictly nested ranges [i, 2n - i) plus one point inside each ring: the point at i belongs to
    # ring i, the innermost range that contains it.
    n = 20_000
    starts = np.arange(n, dtype=np.int64)
    ends = 2 * n - starts
    groups = np.zeros(n, np.int64)
    iv_parent, pt_parent = innermost_enclosing(groups, starts, ends, groups, starts)
    assert np.array_equal(iv_parent, np.arange(-1, n - 1))
    assert np.array_equal(pt_parent, np.arange(n))
