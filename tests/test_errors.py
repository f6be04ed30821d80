"""The one reason/detail error base: every user keeps its name, message and type, and pickles."""

import pickle

import pytest

from echo_rl.broadcast.fetch import NotYet, SourceFailed
from echo_rl.core.errors import ReasonError
from echo_rl.core.wire import WireError
from echo_rl.data.records import RecordError


@pytest.mark.parametrize(
    "err",
    [
        WireError("bad_type", "x"),
        RecordError("too_long", "y"),
        SourceFailed("corrupt", "z", index=3),
        NotYet("later", 7),
    ],
)
def test_reason_errors_keep_message_and_pickle(err):
    assert isinstance(err, ReasonError)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err) == f"{err.reason}: {err.detail}"
    assert back.__dict__ == err.__dict__


def test_value_errors_stay_value_errors():
    assert isinstance(WireError("a", "b"), ValueError)
    assert isinstance(RecordError("a", "b"), ValueError)
    assert str(SourceFailed("refused", "busy")) == "refused: busy"
    assert SourceFailed("refused", "busy").index == -1
