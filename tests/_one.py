import sys, faulthandler, dist_utils, sync_cases
def worker(rank, n, case, variant):
    faulthandler.dump_traceback_later(20, exit=True)
    sync_cases.check_case(case, variant, rank, n)
    return "ok"
if __name__ == "__main__":
    for case in sys.argv[1].split(","):
        for v in sync_cases.VARIANTS[:6]:
            try:
                dist_utils.run_ranks(3, worker, case, v, timeout=40); print(case, v, "ok", flush=True)
            except AssertionError as e: print(case, v, "FAIL", str(e)[-800:], flush=True)
