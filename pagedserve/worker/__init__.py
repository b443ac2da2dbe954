"""The real executor: turns a SchedulerOutput into tensors, runs the model, samples."""
