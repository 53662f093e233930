"""Pipeline parallelism: schedules as data, stage partitions, the PipelineModule, and the engine that runs them."""
