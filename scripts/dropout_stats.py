"""Statistical study of the dropout keep mask (golden.dropout) over several seeds, larger than the unit tests.

For each seed: 16-bit hash values of a 2 x 2 x 512 x 1024 problem (2M elements); prints |z| (deviation in
standard deviations from what independent uniform draws give) of
  bits     the fairness of each of the 16 bits of v (largest |z| over the bits)
  cols     the correlation of keep decisions at column lags 1, 2, 3, 4, 8, 16, 64, 256
  rows     the correlation at row lags 1, 2, 3, 8
  heads    the correlation between heads and between batches
for keep probabilities 0.5, 0.9 and 0.1 (largest |z| over lags and probabilities). With ~40 statistics per
seed a healthy hash shows a largest |z| of about 3; a structural defect shows tens or thousands.

    python scripts/dropout_stats.py [--seeds 8]
"""
import argparse
import math
import time


from golden import dropout as D

SEEDS = [(1234, 7), (99, 1), (0, 0), (5, 6), (1, 0), (42, 42), (2**31, 0), (12345678, 9), (-1, 0), (7, 7),
         (65536, 0), (3, 2**31)]


def _corr(a, b):
    a = a - a.mean()
    b = b - b.mean()
    return float((a * b).mean() / (a.std(unbiased=False) * b.std(unbiased=False)))


def study(seed, bs=2, nheads=2, sq=512, sk=1024):
    """``{statistic: largest |z|}`` for one seed."""
    v = D.hash_values(D.make_seed(*seed), bs, nheads, sq, sk)
    n = v.numel()
    sig = 1.0 / math.sqrt(n)
    bits = max(abs(float(((v >> b) & 1).double().mean()) - 0.5) / (0.5 * sig) for b in range(16))
    cols = rows = heads = 0.0
    for t in (32768, D.keep_threshold(0.1), D.keep_threshold(0.9)):
        m = (v < t).double()
        cols = max([cols] + [abs(_corr(m[..., :-d], m[..., d:])) / sig for d in (1, 2, 3, 4, 8, 16, 64, 256)])
        rows = max([rows] + [abs(_corr(m[:, :, :-d], m[:, :, d:])) / sig for d in (1, 2, 3, 8)])
        half = sig * math.sqrt(2)  # head-vs-head and batch-vs-batch compare n / 2 pairs
        heads = max(heads, abs(_corr(m[:, 0], m[:, 1])) / half, abs(_corr(m[0], m[1])) / half)
    return {"bits": bits, "cols": cols, "rows": rows, "heads": heads}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=8, help=f"how many of the {len(SEEDS)} listed seeds")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    worst = 0.0
    print(f"{'seed':>24} {'bits':>6} {'cols':>6} {'rows':>6} {'heads':>6}   (largest |z|)")
    for seed in SEEDS[:args.seeds]:
        z = study(seed)
        worst = max([worst] + list(z.values()))
        print(f"{str(seed):>24} {z['bits']:6.1f} {z['cols']:6.1f} {z['rows']:6.1f} {z['heads']:6.1f}", flush=True)
    print(f"largest |z| over all: {worst:.1f}  ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
