"""The eager path of a PipelineJob: the master runs the user's own forward on real tensors
(data-dependent Python, keyword arguments, tuples with None: whatever runs in one process),
and the costly submodules live on the stages, called there over torch.distributed.rpc; the
backward is distributed autograd's, one context per micro-batch, and each stage sums its
micro-batches' gradients in micro-batch order and steps its own optimizer. The seeds' RPC
pipeline made general. A sibling of rpc/ and pipelining/, importing neither; it runs on the
rpc engine's world (stages that serve the master's calls).

- placement.py: which submodules go to which stage (measured cost, in the order they run);
- check.py: the placement checked in one process before the world forms;
- held.py: what a stage holds (its modules under the model's names, its optimizer);
- replica_sums.py: a stage's gradients summed over the replicas, in replica order;
- turns.py: a stage computes each module's micro-batches in micro-batch order;
- remote.py: the master's stand-in for a module that lives on a stage;
- one_step.py: a step on the master (a thread per micro-batch); run.py: the master's run;
- saved.py: checkpoints and the resume from one; held_out.py: held-out evaluation;
- moving_average.py: spec.ema's averages, the stages' and the glue's."""
