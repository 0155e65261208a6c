"""The disk tier's periodic upkeep on its rescan thread: the limit after a full filesystem, the
older formats' namespaces, and the shared ledger's reconciliation with the files on disk."""

from __future__ import annotations

from pathlib import Path

from kvoffload.tiers.disk.directory import free_bytes
from kvoffload.tiers.disk.jobs import DiskJobRunner
from kvoffload.tiers.disk.ledger import SpaceLedger
from kvoffload.tiers.disk.reclaim import OldNamespaces
from kvoffload.tiers.disk.scan import census_files

__all__ = ["RECONCILE_EVERY_TICKS", "LedgerUpkeep"]

#: Rescan ticks between two ledger reconciliations when nothing asked for one sooner.
RECONCILE_EVERY_TICKS = 30


class LedgerUpkeep:
    """What the rescan thread does each tick besides the rescan (:meth:`tick`), for one tier's
    namespace. ``sized``: files differ in size (a compressed tier; each counted by its own
    bytes), else each takes ``file_bytes``. The tick count is the rescan thread's alone."""

    def __init__(
        self,
        namespace: Path,
        ledger: SpaceLedger,
        runner: DiskJobRunner,
        old_namespaces: OldNamespaces,
        file_bytes: int,
        sized: bool,
    ) -> None:
        self.namespace = namespace
        self.file_bytes = file_bytes
        self.sized = sized
        self._ledger = ledger
        self._runner = runner
        self._old_namespaces = old_namespaces
        # Rescan ticks since the last reconciliation (rescan thread only).
        self._ticks_unreconciled = 0

    def tick(self) -> None:
        """The rescan thread's other periodic work: the limit after a full filesystem, the
        older formats' namespaces that were in use at the last try, and the ledger's
        reconciliation when it is due (:meth:`reconcile`)."""
        self.refit_filesystem_when_idle()
        if self._old_namespaces.in_use:
            self._old_namespaces.reclaim()
        self._ticks_unreconciled += 1
        due = self._ticks_unreconciled >= RECONCILE_EVERY_TICKS or self._runner.missing_files
        if due or self._ledger.census().dead_slots:  # a dead process: one locked read a tick
            self.reconcile()

    def reconcile(self) -> bool:
        """Make the shared ledger count the namespace's block files, if no process (this one
        included) has a write in flight: a killed writer's reservations, and the bytes of files
        removed by hand, leave the count; killed writers' temporaries and spares, and the spares
        of processes that are gone, are removed. The walk runs unlocked; the count is set only
        if no ledger step of any process came between (else False: the next tick tries again).
        Runs on the rescan thread (each tick it is due: a dead process's slot, a load that
        found a file missing, or every :data:`RECONCILE_EVERY_TICKS` ticks), and at close."""
        census = self._ledger.census()
        if not census.quiescent:
            return False
        counted, garbage = census_files(self.namespace, census.live_owners, measure=self.sized)
        on_disk = counted if self.sized else counted * self.file_bytes
        if not self._ledger.settle_census(census, on_disk, garbage):
            return False
        self._ticks_unreconciled = 0
        self._runner.missing_files = False
        return True

    def refit_filesystem_when_idle(self) -> None:
        """After the filesystem filled, raise the limit again as space comes back (rescan
        thread; only while no job is in flight, so no write of ours is half counted)."""
        ledger = self._ledger
        if ledger.limit < ledger.capacity and self._runner.idle:
            ledger.refit(lambda: free_bytes(self.namespace), self.file_bytes)
