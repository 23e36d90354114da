"""radixserve as a Ray Serve application (``app.py``, which needs ``ray[serve]``)."""

# build_app's arguments (``serve run radixserve.api.ray.app:build_app KEY=VALUE ...``)
APP_ARGS = frozenset(
    {
        "replicas",
        "min_replicas",
        "max_replicas",
        "target_ongoing_requests",
        "serve_args",
        "num_cpus",
        "num_gpus",
        "policy",
        "prefix_cache_scope",
        "retry_timeout_s",
        "max_retries",
        "max_ongoing_requests",
        "transport",
    }
)
