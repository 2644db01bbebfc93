"""Start ``msa-fed site serve`` with every SiteWorker lying (tests/runtime/liars.py; the lie and
the liar's name come from MSA_FED_TEST_LIE and MSA_FED_TEST_LIAR).  Used as a launcher prefix:
``python liar_site.py python -m msa_fed.cli site serve --config site.toml``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

import liars  # noqa: E402

from msa_fed.cli import main  # noqa: E402

if __name__ == "__main__":
    liars.patch_site_worker()
    args = sys.argv[1:]
    sys.exit(main(args[args.index("msa_fed.cli") + 1 :]))
