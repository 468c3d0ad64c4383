from harness.fixtures import cluster, crds, kubelet, operator  # noqa: F401  (tests/harness)
