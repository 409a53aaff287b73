"""Every rank must train on the rows rank 0 prepared: a rank whose data differs (another
node's files, a Hub branch that moved between two downloads) stops the run, named."""

import pytest

from keel.errors import DataError
from keel.train.same_data import check_same_data


class Ranks:
    """A stand-in for a DistContext whose ranks hold (fingerprint, host) pairs."""

    def __init__(self, *seen):
        self.distributed, self.seen, self.asked = True, list(seen), []

    def gather_objects(self, obj, *, slow=False):
        self.asked.append((obj, slow))
        return self.seen


def test_ranks_with_the_same_data_pass_and_one_that_differs_is_named():
    same = Ranks(("a" * 64, "node-a"), ("a" * 64, "node-a"), ("a" * 64, "node-b"))
    check_same_data("a" * 64, same)
    assert same.asked[0][1] is True  # on the slow group: ranks finish preparing unevenly
    differs = Ranks(("a" * 64, "node-a"), ("a" * 64, "node-a"), ("b" * 64, "node-b"))
    with pytest.raises(DataError, match=r"rank 2 \(host node-b\) prepared other data than rank 0 "
                       r"\(host node-a\): data fingerprint bbbbbbbbbbbb there") as err:  # fmt: skip
        check_same_data("a" * 64, differs)
    assert "1 of 3 ranks differ" in str(err.value) and "revision to a commit" in str(err.value)
    assert err.value.exit_code == 2
