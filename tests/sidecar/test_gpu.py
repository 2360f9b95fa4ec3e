"""The NVML mapping, driven by a stand-in for pynvml (no GPU on CI), and the real library."""

from __future__ import annotations

import logging

import pytest
from promptlb.shared import GpuSample
from promptlb.sidecar._gpu import RETRY_S, GpuCollector

from tests.sidecar.conftest import FakeNvml


def test_every_gpu_is_reported_with_what_it_has(nvml: FakeNvml) -> None:
    gpus = GpuCollector(nvml)
    gpus.open()
    samples = gpus.sample()
    assert samples == (
        GpuSample(0, 0.87, 70_000, 81_559, 71, 313),
        GpuSample(1, 0.03, 1_000, 81_559, 40, None),
    )
    # Whole degrees and watts (rounded from milliwatts), as ints: they pack in 1-3 bytes.
    assert [type(g.temp_c) for g in samples] == [int, int]
    assert type(samples[0].power_w) is int
    gpus.close()
    gpus.close()
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


def test_only_the_chosen_gpus_are_read_by_index_or_uuid(
    caplog: pytest.LogCaptureFixture, nvml: FakeNvml
) -> None:
    # Two model servers on one host: each sidecar reads its own server's GPUs, not the average
    # of the host's.
    uuid = nvml.nvmlDeviceGetUUID(1)
    for devices, indices in ((("1",), [1]), ((uuid,), [1]), (("0", uuid), [0, 1])):
        gpus = GpuCollector(nvml, devices=devices)
        gpus.open()
        assert [g.i for g in gpus.sample()] == indices  # NVML's index, as nvidia-smi shows it
        gpus.close()
    with caplog.at_level(logging.WARNING, "promptlb.sidecar.gpu"):
        gpus = GpuCollector(nvml, devices=("7",))
        gpus.open()
        assert gpus.sample() == ()
        assert "none of the GPUs 7 among 2" in gpus.reason
        gpus.close()
    assert [r.getMessage() for r in caplog.records] == [
        "no GPU metrics: none of the GPUs 7 among 2"
    ]


def test_another_servers_lost_gpu_does_not_hide_the_chosen_ones(
    monkeypatch: pytest.MonkeyPatch, nvml: FakeNvml
) -> None:
    uuid_of = nvml.nvmlDeviceGetUUID
    asked: list[int] = []

    def uuid(h: int) -> str:
        asked.append(h)
        if h == 0:
            raise RuntimeError("GPU is lost")  # GPU 0, another server's, fell off the bus
        return uuid_of(h)

    monkeypatch.setattr(nvml, "nvmlDeviceGetUUID", uuid)
    for devices in (("1",), (uuid_of(1),)):
        gpus = GpuCollector(nvml, devices=devices)
        gpus.open()
        assert [g.i for g in gpus.sample()] == [1]
        gpus.close()
    assert 1 in asked and asked.count(0) == 1  # by index alone, no UUID is asked for


def test_gpus_that_all_fail_for_a_while_are_listed_afresh(nvml: FakeNvml) -> None:
    clock = {"now": 0.0}
    gpus = GpuCollector(nvml, clock=lambda: clock["now"])
    gpus.open()
    nvml.broken |= {0, 1}  # the driver lost them
    assert gpus.sample() == ()
    clock["now"] += RETRY_S / 2
    assert gpus.sample() == () and nvml.inits == 1  # not yet: a blip is waited out
    clock["now"] += RETRY_S
    assert gpus.sample() == () and nvml.shutdowns == 1
    nvml.broken.clear()  # back
    assert [g.i for g in gpus.sample()] == [0, 1] and nvml.inits == 2
    gpus.close()


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # NVML has no utilisation for a card in MIG mode. Taken for a lost card, each was left
        # out, memory and all, and with every card so NVML was restarted every RETRY_S.
        ("mig", [(0, None, 70_000, 81_559), (1, None, 1_000, 81_559)]),
        # Nor memory for a unified-memory board (GB10): the same, until it read 0 of 0.
        ("unified", [(0, 0.87, 0, 0), (1, 0.03, 0, 0)]),
    ],
)
def test_a_card_without_a_reading_nvml_has_not_is_reported_and_nvml_stays_up(
    caplog: pytest.LogCaptureFixture,
    nvml: FakeNvml,
    mode: str,
    expected: list[tuple[int, float | None, int, int]],
) -> None:
    clock = {"now": 0.0}
    gpus = GpuCollector(nvml, clock=lambda: clock["now"])
    gpus.open()
    getattr(nvml, mode).update({0, 1})
    with caplog.at_level(logging.INFO, "promptlb.sidecar.gpu"):
        for _ in range(3):
            assert [(g.i, g.util, g.mem_used, g.mem_total) for g in gpus.sample()] == expected
            clock["now"] += RETRY_S
    assert (nvml.inits, nvml.shutdowns) == (1, 0) and not caplog.records
    gpus.close()


def test_a_card_that_cannot_be_opened_hides_no_other(
    caplog: pytest.LogCaptureFixture, nvml: FakeNvml
) -> None:
    """One handle failing (a card off the bus, one the cgroup hides) failed the whole listing:
    no GPU at all, every RETRY_S, for as long as that card stayed bad."""
    nvml.lost.add(0)
    for devices in ((), ("1",), (nvml.nvmlDeviceGetUUID(1),)):
        gpus = GpuCollector(nvml, devices=devices)
        with caplog.at_level(logging.WARNING, "promptlb.sidecar.gpu"):
            gpus.open()
        assert [g.i for g in gpus.sample()] == [1] and gpus.reason == ""
        gpus.close()
    # Named by index, another server's lost card is never opened, nor logged.
    assert sum("cannot be opened" in r.getMessage() for r in caplog.records) == 2


def test_a_card_that_could_not_be_opened_is_found_once_it_is_back(nvml: FakeNvml) -> None:
    """Opened one by one, the others report; but a card that failed was never listed again
    while another card opened (before, the whole listing failed and was retried)."""
    clock = {"now": 0.0}
    nvml.lost.add(0)
    gpus = GpuCollector(nvml, clock=lambda: clock["now"])
    gpus.open()
    assert [g.i for g in gpus.sample()] == [1]
    nvml.lost.clear()
    clock["now"] += RETRY_S / 2
    assert [g.i for g in gpus.sample()] == [1]  # not listed again before RETRY_S
    clock["now"] += RETRY_S
    assert [g.i for g in gpus.sample()] == [0, 1] and nvml.inits == 1
    gpus.close()
    nvml.lost |= {0, 1}
    gpus = GpuCollector(nvml)
    gpus.open()
    assert gpus.sample() == () and gpus.reason == "no GPU could be opened (2 tried)"
    gpus.close()
    # Named by UUID, every card is opened to read its UUID: the one named, lost, cannot be
    # told from the others, and the reason read as if its UUID were wrong.
    nvml.lost = {0}
    gpus = GpuCollector(nvml, devices=(nvml.nvmlDeviceGetUUID(0),))
    gpus.open()
    assert gpus.sample() == () and gpus.reason.endswith("(1 could not be opened or read)")
    gpus.close()
    # Opened, but its UUID unreadable (a lost card fails there too): the same.
    nvml.lost = set()
    uuid_of = nvml.nvmlDeviceGetUUID
    named = uuid_of(0)

    def unreadable(h: int) -> str:
        if h == 0:
            raise RuntimeError("GPU is lost")
        return uuid_of(h)

    nvml.nvmlDeviceGetUUID = unreadable  # type: ignore[method-assign]
    gpus = GpuCollector(nvml, devices=(named,))
    gpus.open()
    assert gpus.sample() == () and gpus.reason.endswith("(1 could not be opened or read)")
    gpus.close()


def test_a_card_unreadable_while_another_cannot_be_opened_is_logged_once(
    caplog: pytest.LogCaptureFixture, nvml: FakeNvml
) -> None:
    """Listing again every RETRY_S cleared every opened card's problem: an unreadable card
    logged "ok again" and its problem anew at each listing."""
    clock = {"now": 0.0}
    nvml.lost.add(0)
    nvml.broken.add(1)
    gpus = GpuCollector(nvml, clock=lambda: clock["now"])
    with caplog.at_level(logging.INFO, "promptlb.sidecar.gpu"):
        gpus.open()
        for _ in range(4):
            gpus.sample()
            clock["now"] += RETRY_S
    said = [r.getMessage() for r in caplog.records]
    assert sum("GPU 1" in m for m in said) == 1, said
    gpus.close()


def test_a_lost_gpu_is_left_out_and_logged_once(
    caplog: pytest.LogCaptureFixture, nvml: FakeNvml
) -> None:
    gpus = GpuCollector(nvml)
    gpus.open()
    nvml.broken.add(0)
    with caplog.at_level(logging.WARNING, "promptlb.sidecar.gpu"):
        for _ in range(3):
            assert [g.i for g in gpus.sample()] == [1]
    assert len(caplog.records) == 1
    gpus.close()


def test_each_failing_gpu_is_logged_once_and_so_is_its_recovery(
    caplog: pytest.LogCaptureFixture,
    nvml: FakeNvml,
) -> None:
    gpus = GpuCollector(nvml)
    gpus.open()
    with caplog.at_level(logging.INFO, "promptlb.sidecar.gpu"):
        nvml.broken.update((0, 1))
        for _ in range(3):
            assert gpus.sample() == ()
        nvml.broken.clear()
        for _ in range(3):
            assert [g.i for g in gpus.sample()] == [0, 1]
    messages = [r.getMessage() for r in caplog.records]
    # Two GPUs failing together: one line each, not a line per GPU per sample.
    assert len(messages) == 4, messages
    assert messages[0].startswith("GPU 0: ") and "GPU is lost" in messages[0]
    assert messages[1].startswith("GPU 1: ") and "GPU is lost" in messages[1]
    assert messages[2:] == ["GPU 0: ok again", "GPU 1: ok again"]
    gpus.close()


def test_a_gpu_whose_memory_is_unreadable_is_left_out_and_logged_once(
    caplog: pytest.LogCaptureFixture,
    nvml: FakeNvml,
) -> None:
    gpus = GpuCollector(nvml)
    gpus.open()
    nvml.broken_memory.add(1)
    with caplog.at_level(logging.WARNING, "promptlb.sidecar.gpu"):
        for _ in range(3):
            assert [g.i for g in gpus.sample()] == [0]
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 1: left out, memory unreadable: Unknown Error"
    ]
    gpus.close()


def test_a_gpu_sampled_after_close_reports_nothing(nvml: FakeNvml) -> None:
    gpus = GpuCollector(nvml)
    gpus.open()
    gpus.close()
    assert gpus.sample() == ()


def test_no_nvml_gives_an_empty_list_logged_once(
    caplog: pytest.LogCaptureFixture, nvml: FakeNvml
) -> None:
    nvml.init_fails = True
    gpus = GpuCollector(nvml)
    with caplog.at_level(logging.INFO, "promptlb.sidecar.gpu"):
        gpus.open()
        assert gpus.sample() == ()
        assert gpus.sample() == ()
    assert "NVML unavailable" in gpus.reason
    assert len(caplog.records) == 1
    gpus.close()
    assert nvml.shutdowns == 0  # never initialised, so never shut down


def test_nvml_that_failed_to_start_is_tried_again_until_the_gpus_are_there(
    caplog: pytest.LogCaptureFixture, nvml: FakeNvml
) -> None:
    # A sidecar that starts before the driver or the device plugin is ready.
    nvml.init_fails = True
    now = [0.0]
    gpus = GpuCollector(nvml, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, "promptlb.sidecar.gpu"):
        gpus.open()
        assert gpus.sample() == ()
        now[0] += RETRY_S
        assert gpus.sample() == ()  # tried again, failed the same way: not logged again
        assert nvml.inits == 2 and len(caplog.records) == 1
        nvml.init_fails = False
        assert gpus.sample() == ()  # not before the next retry
        now[0] += RETRY_S
        assert len(gpus.sample()) == 2
    assert nvml.inits == 3 and gpus.reason == ""
    assert "GPU metrics: 2 GPUs" in caplog.records[-1].message
    gpus.close()
    assert nvml.shutdowns == 1
    now[0] += RETRY_S
    assert gpus.sample() == ()  # closed: not opened again


def test_without_the_library_there_are_no_gpus() -> None:
    gpus = GpuCollector(None)
    gpus.open()
    assert gpus.sample() == ()
    assert gpus.reason == "nvidia-ml-py is not installed"


def test_the_real_library_on_this_host_never_crashes() -> None:
    # CI has no GPU: the real pynvml then fails to initialise and the list is empty. On a GPU
    # host every entry must still be a valid sample.
    gpus = GpuCollector()
    gpus.open()
    try:
        samples = gpus.sample()
        assert all(
            isinstance(g, GpuSample) and (g.util is None or 0.0 <= g.util <= 1.0) for g in samples
        )
        if not samples:  # (CI): the reason is NVML's own, not some other failure of ours
            assert gpus.reason.startswith(("NVML unavailable: ", "NVML reports no GPU")), (
                gpus.reason
            )
    finally:
        gpus.close()


def test_disabled_collection_does_not_touch_nvml(nvml: FakeNvml) -> None:
    gpus = GpuCollector(nvml, enabled=False)
    gpus.open()
    assert gpus.sample() == ()
    assert nvml.inits == 0


def test_a_glitched_sensor_is_no_reading(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    # 255 degrees and an all-ones milliwatt count were passed on: out of the wire format's
    # range, every /snapshot of the node answered 500.
    monkeypatch.setattr(nvml, "nvmlDeviceGetTemperature", lambda h, sensor: 255)
    monkeypatch.setattr(nvml, "nvmlDeviceGetPowerUsage", lambda h: 0xFFFFFFFF)
    gpus = GpuCollector(nvml)
    gpus.open()
    samples = gpus.sample()
    assert [(g.temp_c, g.power_w) for g in samples] == [(None, None), (None, None)]
    gpus.close()
