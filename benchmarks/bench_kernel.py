"""Run `treeflash bench kernel` as a script (e.g. on the H200): python benchmarks/bench_kernel.py --help"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from treeflash.bench.kernel import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
