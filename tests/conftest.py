from harness.fixtures import (  # noqa: F401  (tests/harness)
    cluster,
    coscheduling,
    crds,
    kubelet,
    kueue,
    operator,
    volcano,
)
