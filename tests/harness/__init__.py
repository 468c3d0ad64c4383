"""Test harness: an API server emulator (kmock plus what the tests rely on), a process-kubelet
that runs Pods as local processes, and the operator run against them. See tests/test_harness.py."""
