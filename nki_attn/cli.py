"""The ``nki-attn`` command line."""
import argparse
import sys


def _demo(args):
    import numpy as np

    from .backend import BACKEND
    from .kernels.demo import matmul_exp

    rng = np.random.default_rng(0)
    lhsT = rng.standard_normal((128, 256)).astype(np.float32) * 0.1
    rhs = rng.standard_normal((128, 1024)).astype(np.float32) * 0.1
    out = matmul_exp(lhsT, rhs, 0.5)
    ref = np.exp(0.5 * (lhsT.astype(np.float64).T @ rhs))
    err = float(np.max(np.abs(out - ref) / ref))
    ok = err < 1e-5
    print(f"backend={BACKEND} demo matmul_exp [128x256]^T @ [128x1024]: max rel err {err:.2e} "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def build_parser():
    """The ``nki-attn`` argument parser with its subcommands (demo, check, profile)."""
    parser = argparse.ArgumentParser(prog="nki-attn", description="nki-attn tools: check the kernels against the "
                                     "golden, profile them on a modeled Trainium, run a demo kernel. Usage errors "
                                     "exit with status 2.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="run a demo kernel and check it against numpy")
    p.set_defaults(func=_demo)
    from .harness.cli import add_parser as _add_check
    _add_check(sub)
    from .profiler.cli import add_parser as _add_profile
    _add_profile(sub)
    return parser


def main(argv=None):
    """Parse ``argv`` (default sys.argv) and run the subcommand; returns its exit status."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
