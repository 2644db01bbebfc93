"""Jobs: the job file, running a job against a registry and a Ray cluster, the demo."""
