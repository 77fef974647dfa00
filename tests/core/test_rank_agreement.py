"""The two data-parallel release hooks share ONE rank agreement (``dpopt.distributed.RankAgreement``).

``AllReduceRelease`` (replicas) and ``fsdp.ShardedRelease`` (FSDP2) are both the Privatizer's ``reduce``
hook; the Privatizer asks either one ``any_rank(flag)`` before a release (a ledger write that failed on one
rank stops it on all). The method and its ``agree_records`` switch are written once; the agreement itself
over 2 gloo ranks is exercised by tests/distributed/test_ddp_ledger_write_failure.py and test_fsdp_train.py.
"""

from __future__ import annotations

from dpopt import fsdp
from dpopt.distributed import AllReduceRelease, DistributedContext, RankAgreement


def test_both_release_hooks_use_the_one_any_rank():
    assert AllReduceRelease.any_rank is RankAgreement.any_rank
    assert fsdp.ShardedRelease.any_rank is RankAgreement.any_rank
    assert "any_rank" not in vars(AllReduceRelease) and "any_rank" not in vars(fsdp.ShardedRelease)
    assert AllReduceRelease.agree_records is True and fsdp.ShardedRelease.agree_records is True


def test_any_rank_of_one_process_is_the_flag():
    one = DistributedContext()  # no process group: the flag itself, no collective
    for hook in (AllReduceRelease(one), fsdp.ShardedRelease([], one)):
        assert hook.any_rank(True) is True and hook.any_rank(False) is False
    hook = AllReduceRelease(one)
    hook.agree_records = False  # dpopt train's switch is per hook, the class keeps agreeing
    assert AllReduceRelease.agree_records is True
