"""pipejob: Kubernetes-native RPC pipeline-parallel and hybrid DDP+RPC training."""
