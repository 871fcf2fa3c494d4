"""Stage timings charge each stage its own device work: the clock synchronises before every reading."""

from fusionrag.models.clock import StageClock


class FakeDevice:
    """Time advances when queued work is waited for, as on an asynchronous GPU."""

    def __init__(self) -> None:
        self.t = 0.0
        self.queued = 0.0
        self.syncs = 0

    def launch(self, seconds: float) -> None:
        self.queued += seconds  # returns at once, like a CUDA kernel launch

    def sync(self) -> None:
        self.syncs += 1
        self.t += self.queued
        self.queued = 0.0

    def now(self) -> float:
        return self.t


def test_each_stage_is_charged_its_own_asynchronous_work():
    dev = FakeDevice()
    clock = StageClock(now=dev.now, sync=dev.sync)
    dev.launch(0.010)
    clock.lap("load")
    dev.launch(0.200)  # the recompute pass: queued, not yet run
    clock.lap("recompute")
    clock.lap("first_token")  # without a sync before the recompute lap, its 200 ms would land here
    assert {k: round(v, 9) for k, v in clock.stages.items()} == {"load": 10.0, "recompute": 200.0, "first_token": 0.0}
    assert abs(clock.total() - 210.0) < 1e-9
    assert dev.syncs == 5  # start, three laps, total


def test_a_skipped_stage_is_zero_and_reads_no_clock():
    dev = FakeDevice()
    clock = StageClock(now=dev.now, sync=dev.sync)
    clock.skip("select")
    assert clock.stages == {"select": 0.0} and dev.syncs == 1
