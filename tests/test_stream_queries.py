"""The tile counter's driver queries and its once-only allocation, on the CPU with the driver faked:
both ways to the driver (ctypes on libcuda, the cuda-python bindings) give the value and name the
failing call."""

import ctypes
import threading
import time

import pytest

from fa4tune.kernels.common import streams


class FakeLibcuda:
    """libcuda's two stream queries: they write `values[name]` through the pointer, return
    `code`."""

    def __init__(self, values, code=0):
        self.values, self.code, self.calls = values, code, []
        for name in values:
            setattr(self, name, self._function(name))

    def _function(self, name):
        def call(stream, out):
            self.calls.append((name, stream))
            out._obj.value = self.values[name]
            return self.code

        return call


def queries(lib):
    q = streams._StreamQueries.__new__(streams._StreamQueries)
    q.lib, q.ctypes = lib, ctypes
    return q


def test_ctypes_queries_return_the_values_the_driver_writes():
    lib = FakeLibcuda({"cuStreamGetId": 2**40 + 7, "cuStreamIsCapturing": 1})
    q = queries(lib)
    assert q.stream_id(0x1234) == 2**40 + 7
    assert q.capturing(0x1234) is True
    lib.values["cuStreamIsCapturing"] = 0
    assert q.capturing(0x1234) is False
    assert lib.calls == [("cuStreamGetId", 0x1234)] + [("cuStreamIsCapturing", 0x1234)] * 2


@pytest.mark.parametrize(
    "name, call", [("cuStreamGetId", "stream_id"), ("cuStreamIsCapturing", "capturing")]
)
def test_a_driver_error_names_the_call_the_stream_and_the_code(name, call):
    q = queries(FakeLibcuda({"cuStreamGetId": 1, "cuStreamIsCapturing": 0}, code=400))
    with pytest.raises(
        RuntimeError, match=rf"{name} failed for stream 0xbeef: CUDA driver error 400"
    ):
        getattr(q, call)(0xBEEF)


def test_the_bindings_are_used_where_libcuda_could_not_be_opened(monkeypatch):
    driver = pytest.importorskip("cuda.bindings.driver")
    seen = []

    def fake(result):
        def call(stream):
            seen.append(int(stream))
            return result

        return call

    monkeypatch.setattr(driver, "cuStreamGetId", fake((driver.CUresult.CUDA_SUCCESS, 99)))
    monkeypatch.setattr(
        driver,
        "cuStreamIsCapturing",
        fake(
            (
                driver.CUresult.CUDA_SUCCESS,
                driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE,
            )
        ),
    )
    q = queries(None)
    assert q.stream_id(5) == 99 and q.capturing(5) is True
    # On an error the bindings give None for the value.
    monkeypatch.setattr(
        driver, "cuStreamGetId", fake((driver.CUresult.CUDA_ERROR_INVALID_HANDLE, None))
    )
    with pytest.raises(
        RuntimeError, match=r"cuStreamGetId failed for stream 0x5: CUDA driver error 400"
    ):
        q.stream_id(5)
    monkeypatch.setattr(
        driver, "cuStreamIsCapturing", fake((driver.CUresult.CUDA_ERROR_INVALID_HANDLE, None))
    )
    with pytest.raises(
        RuntimeError, match=r"cuStreamIsCapturing failed for stream 0x5: CUDA driver error 400"
    ):
        q.capturing(5)
    assert seen == [5, 5, 5, 5]


def test_a_counter_is_made_once_however_many_threads_ask_at_once():
    table, made, start = {}, [], threading.Barrier(8)

    def make():
        time.sleep(0.01)  # widen the window between the lookup and the insert
        made.append(object())
        return made[-1]

    got = []

    def ask():
        start.wait()
        got.append(streams._cached(table, "key", make))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and got == made * 8 and table == {"key": made[0]}
    assert streams._cached(table, "key", make) is made[0] and len(made) == 1


class FakeCounter:
    def __bool__(self):
        raise AssertionError(
            "the counter's truth was asked: a CUDA tensor would be read back, a sync per call"
        )


class FakeTorchStreams:
    """torch's current-device and current-stream getters, for current_tile_counter."""

    def __init__(self, torch_id, handle, capturing=False, device_index=0):
        self.torch_id, self.handle, self.is_capturing, self.device_index = (
            torch_id,
            handle,
            capturing,
            device_index,
        )

    def functions(self):
        return (
            lambda: self.device_index,
            lambda: self.is_capturing,
            lambda index: (self.torch_id, index, 1),
            lambda index: self.handle,
        )


@pytest.fixture
def fake_launch_path(monkeypatch):
    """current_tile_counter with torch's getters faked: returns (set the fake, the driver-path
    calls)."""
    torch = pytest.importorskip("torch")
    driver_path = []
    monkeypatch.setattr(streams, "_COUNTERS", {})
    monkeypatch.setattr(streams, "_zeroed_counter", lambda device, kept=False: FakeCounter())
    monkeypatch.setattr(streams, "_current_handle", lambda device: 0xCAFE0)
    monkeypatch.setattr(
        streams,
        "tile_counter",
        lambda device, stream: driver_path.append((device, stream)) or "driver",
    )

    def use(fake):
        monkeypatch.setattr(streams, "_TORCH_STREAMS", [None if fake is None else fake.functions()])
        return torch.device("cuda", 0)

    return use, driver_path


@pytest.mark.parametrize(
    "torch_id, handle", [(0x2B, 0x55A0), (0, 0)]
)  # a pool stream; the legacy stream
def test_a_stream_torch_made_gets_its_counter_by_torch_id_without_a_driver_query(
    fake_launch_path, torch_id, handle
):
    use, driver_path = fake_launch_path
    device = use(FakeTorchStreams(torch_id, handle))
    counter = streams.current_tile_counter(device)
    assert streams.current_tile_counter(device) is counter
    assert streams._COUNTERS == {(device, "torch", torch_id): counter} and driver_path == []


@pytest.mark.parametrize(
    "torch_id, handle",
    [
        (
            0x7F00AB00,
            0x7F00AB00,
        ),  # an external stream: torch's id is its handle, which can be reused
        (0x40, 0x55A0),  # an even id that is not the handle: a layout this code does not know
    ],
)
def test_other_streams_go_by_the_driver(fake_launch_path, torch_id, handle):
    use, driver_path = fake_launch_path
    device = use(FakeTorchStreams(torch_id, handle))
    assert streams.current_tile_counter(device) == "driver"
    assert driver_path == [(device, handle)] and streams._COUNTERS == {}


def test_a_capture_gets_a_new_counter_every_call(fake_launch_path):
    use, driver_path = fake_launch_path
    device = use(FakeTorchStreams(0x2B, 0x55A0, capturing=True))
    first, second = streams.current_tile_counter(device), streams.current_tile_counter(device)
    assert first is not second and streams._COUNTERS == {} and driver_path == []


@pytest.mark.parametrize(
    "fake",
    [FakeTorchStreams(0x2B, 0x55A0, device_index=1), None],
    ids=["another device is current", "torch lacks the getters"],
)
def test_otherwise_the_counter_comes_from_the_driver_path(fake_launch_path, fake):
    use, driver_path = fake_launch_path
    device = use(fake)
    assert streams.current_tile_counter(device) == "driver"
    assert driver_path == [(device, 0xCAFE0)] and streams._COUNTERS == {}
