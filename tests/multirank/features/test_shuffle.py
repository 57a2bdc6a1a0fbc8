"""DS-Sync: the schedule's mixing guarantee (pure python) and ShuffleSync on real gloo ranks."""
from __future__ import annotations

import itertools

import pytest
import torch

from dist_utils import run_ranks
from zen_ds.features.ds_sync.schedule import ShuffleSchedule, ceil_log, gossip_rounds

GROUP_SIZES = (2, 3, 4, 8)


# ----------------------------------------------------------------------------- schedule
@pytest.mark.parametrize("g", GROUP_SIZES)
def test_schedule_mixes_everyone_within_the_bound(g):
    for n in range(1, 65):
        s = ShuffleSchedule(n, g, seed=11)
        steps = s.mixing_steps()
        assert steps == s.mixing_bound, (n, g, steps, s.mixing_bound)
        if n % g == 0 or n <= g:
            assert steps == max(1, ceil_log(n, g)), (n, g, steps)
        else:
            assert steps <= ceil_log(n, g) + 2, (n, g, steps)
        for pattern in range(s.patterns):  # every relabelling mixes from its period start
            assert s.mixing_steps(start=pattern * s.period) == steps


@pytest.mark.parametrize("g", GROUP_SIZES)
def test_every_step_is_a_partition_into_small_groups(g):
    for n in (1, 2, 5, 7, 8, 12, 31, 64):
        s = ShuffleSchedule(n, g, seed=3, full_sync_every=5)
        for step in range(2 * s.period * s.patterns + 5):
            groups = s.groups(step)
            assert sorted(r for grp in groups for r in grp) == list(range(n))
            if s.is_full_sync(step):
                assert groups == [tuple(range(n))]
            else:
                assert all(1 <= len(grp) <= g for grp in groups)
        distinct = s.distinct_groups()
        assert len(distinct) == len(set(distinct)) <= s.max_groups()
        assert all(len(grp) >= 2 for grp in distinct)


def test_schedule_is_seeded_and_deterministic():
    a, b, c = ShuffleSchedule(16, 2, seed=1), ShuffleSchedule(16, 2, seed=1), ShuffleSchedule(16, 2, seed=2)
    assert [a.groups(t) for t in range(8)] == [b.groups(t) for t in range(8)]
    assert [a.groups(t) for t in range(8)] != [c.groups(t) for t in range(8)]


def test_left_over_ranks_rotate_through_everyone():
    s = ShuffleSchedule(7, 2, seed=0)  # one left-over label per period, 7 patterns
    alone = set()
    for pattern in range(s.patterns):
        step = pattern * s.period + 1  # a core round: the left-over rank is alone
        alone |= {grp[0] for grp in s.groups(step) if len(grp) == 1}
    assert alone == set(range(7))


def _partitions(items, g):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for size in range(0, min(g - 1, len(rest)) + 1):
        for mates in itertools.combinations(rest, size):
            left = [x for x in rest if x not in mates]
            for tail in _partitions(left, g):
                yield [(first,) + mates] + tail


@pytest.mark.parametrize("n", [3, 5])
def test_odd_n_with_pairs_cannot_mix_in_ceil_log_steps(n):
    """Why the bound has +2 when g does not divide n: no schedule at all does it in ceil(log2 n)."""
    parts = list(_partitions(list(range(n)), 2))
    full = (1 << n) - 1
    for seq in itertools.product(parts, repeat=ceil_log(n, 2)):
        known = [1 << r for r in range(n)]
        for part in seq:
            for grp in part:
                u = 0
                for r in grp:
                    u |= known[r]
                for r in grp:
                    known[r] = u
        assert not all(k == full for k in known)


DOMAINS = [[[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 1, 2], [3, 4, 5, 6, 7]],
           [list(range(8 * i, 8 * i + 8)) for i in range(8)], [[0, 5, 9], [1, 2, 3, 4], [6, 7, 8]]]


@pytest.mark.parametrize("domains", DOMAINS, ids=lambda d: f"{len(d)}dom")
@pytest.mark.parametrize("g", (2, 3, 4))
def test_domain_schedule_keeps_all_but_cross_rounds_inside_domains(domains, g):
    n = sum(map(len, domains))
    s = ShuffleSchedule(n, g, domains=domains)
    where = {r: i for i, d in enumerate(domains) for r in d}
    crossing_steps = 0
    for step in range(s.period):
        groups = s.groups(step)
        assert sorted(r for grp in groups for r in grp) == list(range(n))
        crossing = [grp for grp in groups if len({where[r] for r in grp}) > 1]
        if crossing:
            crossing_steps += 1
            assert all(len({where[r] for r in grp}) == len(grp) for grp in crossing)
    assert crossing_steps == len(gossip_rounds(len(domains), g))
    assert s.mixing_steps() <= s.mixing_bound


def test_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="group_size"):
        ShuffleSchedule(4, 1)
    with pytest.raises(ValueError, match="domains"):
        ShuffleSchedule(4, 2, domains=[[0, 1], [1, 2, 3]])
    with pytest.raises(ValueError, match="full_sync_every"):
        ShuffleSchedule(4, 2, full_sync_every=-1)


# ----------------------------------------------------------------------------- multi-rank
ROWS, HIDDEN = 40, 6


def _model(seed: int = 0, rows: int = ROWS, sparse_emb: bool = True) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.ModuleDict({"emb": torch.nn.Embedding(rows, HIDDEN, sparse=sparse_emb),
                                "tab": torch.nn.Embedding(rows, HIDDEN),
                                "lin": torch.nn.Linear(HIDDEN, 3)})


def _specs(model):
    return [("emb", model["emb"].weight, True), ("tab", model["tab"].weight, True),
            ("lin.w", model["lin"].weight, False), ("lin.b", model["lin"].bias, False)]


def _loss(model, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, 8, (5,), generator=gen) * (1 + rank)  # skewed, rank-dependent supports
    ids[0] = model["emb"].num_embeddings - 1 if rank == 0 else 0  # row 0 and the last row
    h = model["emb"](ids) + model["tab"](ids.flip(0))
    return model["lin"](h).square().mean()


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _train(rank, steps, make_sync, check=None, model=None, make_opt=_sgd):
    """SGD (lr 0.1, no momentum) on rank-local data; ``make_sync(model) -> ShuffleSync | None``."""
    import zen_ds

    model = _model() if model is None else model
    sync = make_sync(model)
    opt = make_opt(model.parameters())
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        _loss(model, rank, step).backward()
        if sync is None:  # ordinary data parallel with zen's reduction, the reference
            for _, p, sparse in _specs(model):
                scheme = "auto" if sparse or p.grad.is_sparse else "dense"
                out = zen_ds.sparse_allreduce(p.grad, scheme=scheme, average=True)
                p.grad = out if p.grad.is_sparse else p.grad.copy_(out)
        else:
            if check is not None:
                check("before", sync, model)
            sync.reduce_gradients()
            opt.step()
            stats = sync.after_optimizer_step()
            if check is not None:
                check("after", sync, model, stats)
            continue
        opt.step()
    return model, sync


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _gather(t):
    import torch.distributed as dist
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _shuffle_worker(rank, world):
    import torch.distributed as dist
    from zen_ds.features.ds_sync.sync import ShuffleParam, ShuffleSync

    res = {}
    ref, _ = _train(rank, 4, lambda m: None)
    ref_flat = _flat(ref)

    # K = 1: exactly data parallel, both modes.
    for mode in ("gradients", "parameters"):
        model, _ = _train(rank, 4, lambda m: ShuffleSync(_specs(m), group_size=2, mode=mode,
                                                          full_sync_every=1))
        res[f"k1_{mode}_bitwise"] = torch.equal(_flat(model), ref_flat)

    # g = n, gradients mode: data parallel (the DP group's own collectives).
    model, sync = _train(rank, 4, lambda m: ShuffleSync(_specs(m), group_size=world))
    res["g_eq_n_bitwise"] = torch.equal(_flat(model), ref_flat)
    res["g_eq_n_no_groups"] = sync.groups.created == 0

    # The schedule is the same on every rank.
    sig = torch.tensor([hash(tuple(sync.schedule.groups(t))) % (2 ** 61) for t in range(12)])
    res["schedule_agrees"] = all(torch.equal(sig, other) for other in _gather(sig))

    # Gradients mode, g = 2: each member's grad is its group's mean; members agree exactly.
    grad_checks = []

    def check_grads(phase, sync, model, stats=None):
        if phase == "before":
            check_grads.local = [_dense_grad(p) for _, p, _ in _specs(model)]
            check_grads.local_all = [_gather(g) for g in check_grads.local]
            return
        members = list(stats.group)
        for (_, p, _), gathered in zip(_specs(model), check_grads.local_all):
            # p.grad after the step still holds the averaged gradient
            want = torch.stack([gathered[m] for m in members]).sum(0) / len(members)
            got = _dense_grad(p)
            grad_checks.append(torch.allclose(got, want, rtol=1e-6, atol=1e-7))
            everyone = _gather(got)
            grad_checks.append(all(torch.equal(everyone[m], got) for m in members))
        grad_checks.append(stats.bytes_sent > 0 and stats.dense_bytes > 0)

    _train(rank, 5, lambda m: ShuffleSync(_specs(m), group_size=2, seed=4), check_grads)
    res["gradients_mode_group_mean"] = all(grad_checks)

    # Parameters mode, g = 2 (and g = 3, which leaves a rank alone at some steps).
    for g in (2, 3):
        checks, bytes_seen, schemes = [], [], set()

        def check_params(phase, sync, model, stats=None):
            if phase == "before":
                return
            flat = _flat(model)
            everyone = _gather(flat)
            members = list(stats.group)
            checks.append(all(torch.equal(everyone[m], flat) for m in members))
            bytes_seen.append(stats.bytes_sent)
            schemes.update(stats.schemes)

        model, sync = _train(rank, 6, lambda m: ShuffleSync(_specs(m), group_size=g, mode="parameters",
                                                             seed=g), check_params)
        res[f"params_g{g}_members_agree"] = all(checks)
        res[f"params_g{g}_bytes"] = sum(bytes_seen) > 0
        res[f"params_g{g}_sparse_scheme"] = bool(schemes - {"dense", "local"})
        res[f"params_g{g}_drifted"] = sync.drifted

    # Sparse-aware parameter averaging is exact: a row changed on one member only is averaged
    # with the other members' unchanged value; rows changed on no member stay as they were.
    model = _model()
    sync = ShuffleSync(_specs(model), group_size=2, mode="parameters", seed=9)
    grp, _ = sync.groups.for_step(0)
    before = [_gather(p.detach().clone()) for _, p, _ in _specs(model)]
    emb, row = model["emb"].weight, 3 + rank  # a different row on every rank
    emb.grad = torch.sparse_coo_tensor(torch.tensor([[row]]), -(1.0 + rank) * torch.ones(1, HIDDEN),
                                       emb.shape)
    sync.reduce_gradients()
    with torch.no_grad():
        emb.sub_(emb.grad.to_dense())  # the "optimizer": moves exactly the rows of the gradient
    sync.after_optimizer_step()
    now = _gather(emb.detach().clone())
    members = list(grp)
    want = before[0][0].clone()
    for m in members:
        want[3 + m] = sum((before[0][0][3 + m] + (1.0 + m) if k == m else before[0][0][3 + m])
                          for k in members) / len(members)
    res["sparse_rows_exact"] = torch.allclose(now[rank], want, rtol=0, atol=1e-6) and \
        all(torch.equal(now[m], now[rank]) for m in members)

    # AdamW changes every row, yet a row-sparse gradient stays row-sparse: gradient mode syncs
    # both embeddings (dense-grad here) with zen's sparse schemes, in pair steps and full steps,
    # and applies exactly what the all-dense average gives.
    def adamw(params):
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)

    def record(runs):
        def check(phase, sync, model, stats=None):
            if phase == "after":
                runs.append((stats, _flat(model)))
        return check

    for k in (0, 3):
        runs = {}
        for sparse_grad in (True, False):
            runs[sparse_grad] = []
            model = _model(rows=4096, sparse_emb=False)
            specs = [ShuffleParam(n, p, sparse_grad and n in ("emb", "tab"), False)
                     for n, p, _ in _specs(model)]
            _train(rank, 5, lambda m: ShuffleSync(specs, group_size=2, full_sync_every=k),
                   record(runs[sparse_grad]), model=model, make_opt=adamw)
        sparse_runs, dense_runs = runs[True], runs[False]
        res[f"adamw_sparse_k{k}_schemes"] = \
            all(set(st.schemes) - {"dense"} for st, _ in sparse_runs) and \
            all(st.schemes == ["dense"] for st, _ in dense_runs)
        # a full step after drift first restores the consensus by averaging the (dense) params
        res[f"adamw_sparse_k{k}_bytes"] = all(
            s.dense_bytes == d.dense_bytes and (s.bytes_sent < d.bytes_sent if s.full else
                                                20 * s.bytes_sent < d.bytes_sent)
            for (s, _), (d, _) in zip(sparse_runs, dense_runs))
        if k == 0:  # pairs only: a + b in either order, halved: bit for bit
            res["adamw_sparse_pairs_bitwise"] = all(torch.equal(a, b) for (_, a), (_, b)
                                                    in zip(sparse_runs, dense_runs))
        else:  # full steps sum four ranks in another order than the library ring: a rounding
            res["adamw_sparse_full_close"] = all(
                torch.allclose(a, b, rtol=1e-5, atol=1e-6) for (_, a), (_, b)
                in zip(sparse_runs, dense_runs)) and any(st.full for st, _ in sparse_runs)

    # A non-contiguous row-sparse gradient (a transposed buffer) is averaged like a contiguous one.
    got = []
    for sparse_grad in (True, False):
        model = _model()
        tab = model["tab"].weight
        sync = ShuffleSync([ShuffleParam("tab", tab, sparse_grad)], group_size=2)
        grad = torch.zeros(HIDDEN, ROWS).t()
        grad[[0, 3 + rank, ROWS - 1]] = torch.arange(3 * HIDDEN, dtype=torch.float32).view(3, -1) * (rank + 1)
        tab.grad = grad
        sync.reduce_gradients()
        got.append((tab.grad.clone(), sync._current.schemes, tab.grad.is_contiguous()))
        sync.after_optimizer_step()
    res["non_contiguous_grad"] = torch.equal(got[0][0], got[1][0]) and got[0][1] != ["dense"] and \
        not got[0][2] and not got[1][2]

    # Spec forms: a triple sets both flags, a 4-tuple / ShuffleParam each, a plain param neither.
    model = _model()
    sync = ShuffleSync([("emb", model["emb"].weight, True), ("tab", model["tab"].weight, True, False),
                        model["lin"].weight], group_size=2)
    res["spec_forms"] = [(s.name, s.sparse_grad, s.track_rows) for s in sync.specs] == \
        [("emb", True, True), ("tab", True, False), ("param2", False, False)]
    try:
        ShuffleSync([("emb", model["emb"].weight)], group_size=2)
        res["spec_bad_refused"] = False
    except ValueError as e:
        res["spec_bad_refused"] = "ShuffleParam" in str(e)

    # Full sync every 3 steps restores the consensus: all replicas identical after steps 2, 5.
    agree = []

    def check_full(phase, sync, model, stats=None):
        if phase == "after" and stats.full:
            flat = _flat(model)
            agree.append(all(torch.equal(flat, other) for other in _gather(flat)))

    for mode in ("gradients", "parameters"):
        agree.clear()
        _train(rank, 6, lambda m: ShuffleSync(_specs(m), group_size=2, mode=mode, full_sync_every=3),
               check_full)
        res[f"full_every3_{mode}"] = len(agree) == 2 and all(agree)

    # Checkpoint: the state resumes the schedule position; other settings are refused.
    model, sync = _train(rank, 3, lambda m: ShuffleSync(_specs(m), group_size=2, mode="parameters"))
    state = sync.state_dict()
    again = ShuffleSync(_specs(model), group_size=2, mode="parameters")
    again.load_state_dict(state)
    res["resume_step"] = again.step == 3 and again.drifted == sync.drifted and \
        torch.equal(again._dirty["emb"], sync._dirty["emb"])
    other = ShuffleSync(_specs(model), group_size=2, mode="parameters", seed=5)
    try:
        other.load_state_dict(state)
        res["resume_mismatch_refused"] = False
    except ValueError as e:
        res["resume_mismatch_refused"] = "same shuffle settings" in str(e)
    dist.barrier()
    return res


def _dense_grad(p):
    g = p.grad
    return g.to_dense() if g.is_sparse else g.detach().clone()


_CASES = ["k1_gradients_bitwise", "k1_parameters_bitwise", "g_eq_n_bitwise", "g_eq_n_no_groups",
          "schedule_agrees", "gradients_mode_group_mean", "params_g2_members_agree", "params_g2_bytes",
          "params_g2_sparse_scheme", "params_g2_drifted", "params_g3_members_agree", "params_g3_bytes",
          "params_g3_sparse_scheme", "sparse_rows_exact", "full_every3_gradients",
          "full_every3_parameters", "resume_step", "resume_mismatch_refused",
          "adamw_sparse_k0_schemes", "adamw_sparse_k0_bytes", "adamw_sparse_pairs_bitwise",
          "adamw_sparse_k3_schemes", "adamw_sparse_k3_bytes", "adamw_sparse_full_close",
          "spec_forms", "spec_bad_refused", "non_contiguous_grad"]


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(4, _shuffle_worker)


@pytest.mark.parametrize("case", _CASES)
def test_shuffle_sync_four_ranks(four_ranks, case):
    assert all(res[case] for res in four_ranks), [res[case] for res in four_ranks]
