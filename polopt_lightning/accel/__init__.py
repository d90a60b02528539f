"""Hardware-specific speed, kept apart from the generic paths: each room here is opt-in or automatic with a stated
fallback (``cpu``: oneDNN products, the few-row decoding kernel, host memory)."""
