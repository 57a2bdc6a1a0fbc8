import cProfile, pstats, io, torch, zen_ds
def work(rank, n, numel, density, scheme):
    torch.manual_seed(rank)
    x = torch.zeros(numel)
    k = int(numel * density)
    idx = torch.randperm(numel)[:k]
    x[idx] = torch.randn(k)
    for _ in range(2):
        zen_ds.sparse_allreduce(x, scheme=scheme)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(3):
        zen_ds.sparse_allreduce(x, scheme=scheme)
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    return s.getvalue() if rank == 0 else None
