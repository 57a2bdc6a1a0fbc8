"""Holder-aware slice owners for ``hierarchical``'s inter-node phase, priced in the simulator's
terms on its own supports (BENCHMARKS.md "nmt at 128 ranks, 8 per node"); a measurement, not
product code, and not collected by pytest:

    python tests/holder_owners_probe.py nmt     # or lstm

Replays today's hash owners (it must match the simulator's push and pull phases), then three
owner rules among a row's holding nodes and the owner floor, and prices each with the phases
that stay, from ``python -m zen_ds sim``.
"""
import json, os, subprocess, sys, tempfile, torch
from zen_ds.tools.bench.workloads import parse_workload
from zen_ds.tools.sim.supports import generate_supports, owner_floor, lossless_bound
from zen_ds.core.partition import ShardLayout
from zen_ds.schemes.topology import Topology
from zen_ds.costmodel.cost import CostModel, LOG_STEP_ALGORITHM, RING_ALGORITHM

wl = sys.argv[1] if len(sys.argv) > 1 else "nmt"
n, k = 128, 8
B, ALPHA = 25e9 / 8, 50e-6
model = CostModel(alpha=ALPHA, bandwidth=B, intra_bandwidth=150e9, compute=())
s = generate_supports(parse_workload(wl, 1.0), n, 0, 0)
topo = Topology.consecutive(n, k)
g, slices = len(topo.nodes), topo.slices
layout = ShardLayout(s.num_rows, slices, s.seed)
vb = max(s.value_bytes, 4); row_bytes = s.row_numel * vb   # partial sums cross nodes in fp32
held = [torch.zeros((g, layout.shard_size(j)), dtype=torch.bool) for j in range(slices)]
for i, node in enumerate(topo.nodes):
    ids = torch.unique(torch.cat([s.rank_ids(r) for r in node]))
    pos = layout.positions(ids); own = layout.owner_of_positions(pos)
    for j in range(slices):
        held[j][i, pos[own == j] - layout.starts[j]] = True
nodes = torch.arange(g)[:, None]
def a2a(rows_nic, entry=row_bytes):  # one all-to-all among the 16-rank slice groups, side by side
    return rows_nic * entry / B + (g - 1) * ALPHA

# ---- hash owners (today's inner balanced, exchanged pull with the single-holder skip, ids 4 B)
pi, po, qi, qo = (torch.zeros(g, dtype=torch.float64) for _ in range(4))
for j in range(slices):
    H = held[j]; o = ShardLayout(H.shape[1], g, s.seed).owner(torch.arange(H.shape[1]))
    h = H.sum(0); u = h > 0
    notown = H & (nodes != o[None, :])
    pi += torch.bincount(o, weights=notown.sum(0).double(), minlength=g); po += notown.sum(1)
    single_holder = torch.where(h == 1, H.to(torch.int64).argmax(0), -1)
    recv = u[None, :] & (nodes != o[None, :]) & (nodes != single_holder[None, :])   # [node, row]
    qi += recv.sum(1); qo += torch.bincount(o, weights=recv.sum(0).double(), minlength=g)
hash_push, hash_pull = float(torch.maximum(pi, po).max()), float(torch.maximum(qi, qo).max())
# ---- the other phases, from the simulator (hierarchical today)
out = os.path.join(tempfile.mkdtemp(), "sim.json")
subprocess.run([sys.executable, "-m", "zen_ds", "sim", "-w", wl, "--ranks", str(n), "--ranks-per-node",
                str(k), "--bandwidth", "25gbit", "--compute", "none", "--json", out], check=True,
               capture_output=True)
d = json.load(open(out)); rows = {r["scheme"]: r for r in d["rows"]}
ph = {p["name"]: p["seconds"] for p in rows["hierarchical"]["phases"]}
print(f"hash owners: push busiest NIC {hash_push:,.0f} rows -> {a2a(hash_push, row_bytes+4)*1e3:.2f} ms "
      f"(simulator {ph['balanced.push']*1e3:.2f}); pull busiest {hash_pull:,.0f} rows (in {qi.max():,.0f}, out {qo.max():,.0f}) -> "
      f"{a2a(hash_pull, row_bytes+4)*1e3:.2f} ms (simulator {ph['balanced.pull']*1e3:.2f}); sum of means {float(pi.mean()+qi.mean()):,.0f}")

def evaluate(owners, name):
    pi, po, qi, qo = (torch.zeros(g, dtype=torch.float64) for _ in range(4))
    for j in range(slices):
        H = held[j]; o = owners[j]; h = H.sum(0); u = h > 0
        idx = torch.nonzero(u).flatten()
        owned = torch.zeros_like(H); owned[o[u], idx] = True
        pushes = H & ~owned  # every holder but the owner sends its partial sum
        pi += torch.bincount(o[u], weights=pushes[:, u].sum(0).double(), minlength=g); po += pushes.sum(1)
        # pull: the sum to every node but the owner and a single holder that is not the owner
        single_holder = torch.where(h == 1, H.to(torch.int64).argmax(0), -1)
        recv = u[None, :] & ~owned & (nodes != single_holder[None, :])
        qi += recv.sum(1); qo += torch.bincount(o[u], weights=recv[:, u].sum(0).double(), minlength=g)
    push, pull = float(torch.maximum(pi, po).max()), float(torch.maximum(qi, qo).max())
    print(f"{name:>34}: push {push:,.0f} rows {a2a(push)*1e3:6.2f} ms | pull {pull:,.0f} rows "
          f"(in {qi.max():,.0f} out {qo.max():,.0f}) {a2a(pull)*1e3:6.2f} ms | push+pull {(a2a(push)+a2a(pull))*1e3:.2f} ms")
    return a2a(push) + a2a(pull)

M = (1 << 61) - 1
def h64(row, node, seed=0):
    x = (row * 1_000_003 + node * 97_531 + seed * 7_919 + 12345) % M
    for mul, sh in ((0x5DEECE66D, 17), (1_103_515_245, 13), (2_654_435_761, 16)):
        x = (x * mul) % M; x = x ^ (x >> sh)
    return x
MAXI = torch.iinfo(torch.int64).max
results = {}
# (a) hash among holders
results["hash among holders"] = evaluate(
    [torch.where(held[j], h64(torch.arange(held[j].shape[1])[None, :] + j * 10**7, nodes), MAXI).argmin(0)
     for j in range(slices)], "hash among holders")
# (b) two choices among holders: the lesser loaded (owned rows so far) of the two lowest hashes
def two_choice():
    load = torch.zeros(g); out = []
    for j in range(slices):
        H = held[j]; key = torch.where(H, h64(torch.arange(H.shape[1])[None, :] + j * 10**7, nodes), MAXI)
        two = key.topk(2, dim=0, largest=False).indices   # [2, rows]
        has2 = (H.sum(0) >= 2)
        # vectorised: per-node weight = rows it would own under (a), then pick the lighter
        first = two[0]; base = torch.bincount(first[H.any(0)], minlength=g).double() + load
        pick = torch.where(has2 & (base[two[1]] < base[two[0]]), two[1], two[0])
        load += torch.bincount(pick[H.any(0)], minlength=g).double(); out.append(pick)
    return out
results["two choices"] = evaluate(two_choice(), "two choices (vectorised)")
# (c) sequential least-loaded greedy, node-global loads, fewest holders first (upper bound of rules)
def greedy(weight_push=1.0, weight_pull=1.0):
    load = [0.0] * g; out = []
    for j in range(slices):
        H = held[j]; h = H.sum(0); Hn = H.numpy(); hn = h.numpy()
        owner = torch.zeros(H.shape[1], dtype=torch.int64); on = owner.numpy()
        for r in torch.argsort(h, stable=True).tolist():
            if hn[r] == 0: continue
            c = min(Hn[:, r].nonzero()[0], key=lambda c: load[c])
            on[r] = c; load[c] += weight_push * (hn[r] - 1) + weight_pull * (g - 1)
        out.append(owner)
    return out
results["greedy"] = evaluate(greedy(), "least-loaded greedy (sequential)")
# (d) the floor: every row owned by a holder, every NIC at the mean (owner_floor)
floor_rows = owner_floor(s, k)
floor = 2 * (g - 1) * ALPHA + floor_rows * row_bytes / B
print(f"{'owner floor, perfect balance':>34}: {floor_rows:,.0f} rows per NIC, push+pull >= {floor*1e3:.2f} ms")

agsparse = rows["agsparse"]["seconds"]; auto_now = rows["auto"]["seconds"]
bound = lossless_bound(s).ratio
bitmap_chunk = (layout.shard_size(0) + 7) // 8 // 8 * 8 + 8
def side_by_side_gather(algorithm):   # 8 slice groups side by side: 8 ranks of a node cross its NIC
    est_steps = {"ring": g - 1, "log_step": 4}[algorithm]
    host = est_steps * 120e-6 if algorithm == "log_step" else 0.0
    return est_steps * ALPHA + host + k * (g - 1) * bitmap_chunk / B
bitmap = min(side_by_side_gather("ring"), side_by_side_gather("log_step"))
keep = sum(v for name, v in ph.items() if name not in ("hierarchical.handshake", "balanced.push",
                                                        "balanced.pull_meta", "balanced.pull"))
print(f"\nsim today: auto {auto_now*1e3:.2f} ms, agsparse {agsparse*1e3:.2f} ms, bound ratio {bound:.4f}, "
      f"fraction {agsparse/auto_now/bound:.4f}; 0.9 needs <= {agsparse/bound/0.9*1e3:.2f} ms, 0.905 <= {agsparse/bound/0.905*1e3:.2f}")
print(f"phases kept by the holder mode (zen handshake, intra counts+push, share counts+share): {keep*1e3:.3f} ms")
print(f"bitmap all-gather ({bitmap_chunk} B per rank, side by side): ring {side_by_side_gather('ring')*1e3:.3f} ms, "
      f"log-step {side_by_side_gather('log_step')*1e3:.3f} ms; replaces the slice handshake "
      f"{ph['hierarchical.handshake']*1e3:.3f} and pull sizes {ph['balanced.pull_meta']*1e3:.3f} ms")
for name, t in list(results.items()) + [("owner floor (perfect balance)", floor)]:
    total = keep + bitmap + t
    print(f"  {name:>32}: hierarchical {total*1e3:7.2f} ms -> fraction {agsparse/total/bound:.4f}")
