"""pipejob: Kubernetes-native RPC pipeline-parallel and hybrid DDP+RPC training.

Torch-free here: `core` (job kinds, spec model, world plan, env contract), `operator` (kopf),
`runner` (local processes) and `cli`. `pipejob.trainer` (trainer/) runs in the pods."""
