"""The torch-free core shared by the operator, the local runner, the CLI and the trainer: the
job kinds, the spec model, the world plan and the env contract."""
