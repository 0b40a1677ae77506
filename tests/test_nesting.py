"""The vectorised nesting agrees with a brute-force innermost-enclosing search on random call stacks."""

import numpy as np

from plasmient_trace.stitch.nesting import innermost_enclosing, tree_depth, tree_root


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


def test_tree_depth_and_root():
    parent = np.array([-1, 0, 0, 1, 3, -1, 5])
    assert tree_depth(parent).tolist() == [0, 1, 1, 2, 3, 0, 1]
    assert tree_root(parent).tolist() == [0, 0, 0, 0, 0, 5, 5]
