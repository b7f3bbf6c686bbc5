"""The seam between the controller and the trainer: everything orchestrator/ uses of trainer/, and
nothing else. The controller imports trainer only through this module (tests/test_layout.py reads
orchestrator/ for it), so this file is the list of what the two sides share and what a change of the
trainer can break on the controller's side.

Torch-free at import, and so is everything it imports: the controller runs where there is no torch
(tests/test_trainer_config.py imports this module and the CLI, and asserts torch stays out). Each name
is re-exported as is, the trainer's own object, so the controller checks and writes things exactly as
the trainer will: its flags, its config rules, its failure catalog, its way of writing tau.
"""
from __future__ import annotations

# the names of the compile policies (`--compile-policy`, the probe's matrix)
from trainer.policies import AUTO, POLICY_CHOICES, POLICY_NAMES
# the training topologies (--topology), one home: the trainer's config
from trainer.run.config import TOPOLOGIES
# the trainer's expected failures: its usage error (bad flags, config, prompt rows) and the exit
# code of a rank that another node's failure ended
from trainer.errors import EXIT_PEER_FAILED, UsageError
# the trainer's flags and config rules: its parser (launch knows its flags), the checks of a launch's
# argv and YAML before anything starts, the precisions and the one the probe emulates alone
from trainer.run.config import EMULATE_ALONE, PRECISIONS
from trainer.run.flags import build_parser, check_before_launch
# the run log: the events also written as text lines, and tau with its interval as the log writes it
from trainer.run.log import TWINNED, tau_text
# how a decode's outputs compare with the target alone's, as specdec says it (lossless first)
from trainer.run.decode_sample import agreement
# regen's reader of a prompts file, so bad rows are refused before a launch (count_prompts: checked, not kept)
from trainer.regen import count_prompts, read_prompts
# the lock file that names its holder (stdlib only), the one under the trainer's one writer per
# output: `play`'s one player per playbook and target
from trainer.lock_file import LockHeld, LockUnopened, lock_file
# what a command may replace (an earlier export, nothing else of the user's) and the swap that does it
from trainer.owned import not_an_export, output_kind
from trainer.files import NotOurs, swap_in
# the failure catalog and its matcher (stdlib + PyYAML): `scan`, `logs`
from trainer.signatures import Catalog, CatalogError, load_catalog

__all__ = ["POLICY_NAMES", "AUTO", "POLICY_CHOICES", "TOPOLOGIES", "EXIT_PEER_FAILED", "UsageError", "EMULATE_ALONE",
           "PRECISIONS", "build_parser", "check_before_launch", "TWINNED", "tau_text", "read_prompts",
           "count_prompts", "Catalog", "CatalogError", "load_catalog", "LockHeld", "LockUnopened", "lock_file",
           "not_an_export", "NotOurs", "swap_in", "agreement", "output_kind"]
