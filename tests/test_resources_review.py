"""`resources.peak_device_memory`: the device it reads."""

from pagedjax import resources, sharding


class _Device:
    def memory_stats(self):
        return dict(peak_bytes_in_use=1234)


def test_peak_device_memory_reads_the_default_device(monkeypatch):
    """It read jax.devices()[0] whatever jax.default_device said, where the model and
    the cache went (`plan_num_pages` reads `sharding.default_device()`): the summary's
    peak was another device's."""
    monkeypatch.setattr(sharding, "default_device", lambda: _Device())
    assert resources.peak_device_memory() == 1234
    assert resources.peak_device_memory(_Device()) == 1234
