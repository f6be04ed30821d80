"""Publishing off the training thread: encode, hash and sign each version on a thread of its own.

Building a publication costs a pass of XOR/LZ4 over the model (``echo_rl.broadcast.versions``) and
BLAKE3 over both the delta and the rebuilt result, then an Ed25519 signature: on a real model,
tenths of a second that the next training step need not wait for. The training thread hands the
version's full payload over (``submit``) and goes on; numpy, LZ4 and BLAKE3 release the GIL.

The hand-over queue holds one version. Overflow policy: a step that finishes while the previous
version is still being built waits for it (back-pressure, measured as ``t_publish``); versions
are never skipped or reordered, so the base of every delta is a version that was published.
A failure on the publisher thread is raised on the training thread at the next ``submit`` or
``flush``, never swallowed. Without the thread (``learner.release_thread`` off, the CPU's
default) ``submit`` builds the version itself.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from echo_rl.broadcast.snapshot import Snapshot
from echo_rl.broadcast.versions import Publication, VersionEncoder
from echo_rl.core.layout import Payload, TensorLayout

log = logging.getLogger(__name__)


class Publisher:
    """``threaded``: build on the publisher thread (a GPU step leaves the host's cores idle);
    False: on the caller's thread, in ``submit`` (a CPU step uses every core, and a thread
    beside it slows it more than the build costs: ``benchmarks/bench_publish.py``, mode
    ``after`` against ``delta-inline``)."""

    def __init__(
        self, encoder: VersionEncoder, publish: Callable[[Snapshot], None], threaded: bool = True
    ):
        self.encoder = encoder
        self.publish = publish
        self.last: Publication | None = None  # the newest publication (its stats)
        self.published = 0
        self.keyframes = 0
        self._queue: queue.Queue[tuple[int, list[TensorLayout], Payload] | None] = queue.Queue(1)
        self._error: BaseException | None = None
        self._thread = (
            threading.Thread(target=self._run, name="echo-publisher", daemon=True)
            if threaded
            else None
        )
        if self._thread is not None:
            self._thread.start()

    def submit(self, version: int, tensors: list[TensorLayout], full: Payload) -> None:
        """Hand a version over; blocks while the previous one is still waiting to be built
        (without the thread: builds it)."""
        self._raise()
        if self._thread is None:
            self._build(version, tensors, full)
        else:
            self._queue.put((version, tensors, full))

    def flush(self) -> None:
        """Wait until every version handed over is published."""
        self._queue.join()
        self._raise()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(60)

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"snapshot publisher failed: {self._error!r}") from self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    self._build(*item)
            except BaseException as exc:  # handed to the training thread by _raise
                self._error = exc
                log.exception("snapshot publisher failed on version %s", item[0] if item else "?")
            finally:
                self._queue.task_done()

    def _build(self, version: int, tensors: list[TensorLayout], full: Payload) -> None:
        pub = self.encoder.build(version, tensors, full)
        self.publish(Snapshot(pub.manifest, pub.payload, pub.result))
        self.last = pub
        self.published += 1
        self.keyframes += pub.manifest.encoding == "full"
        log.debug(
            "published v%d: %s, %d of %d bytes (%.1f%%), built in %.3fs",
            version,
            pub.manifest.encoding,
            len(pub.payload),
            len(pub.result),
            100 * pub.stats.ratio,
            pub.build_s,
        )
