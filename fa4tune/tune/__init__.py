"""The tuning loop: search jobs (job.py), the search over a job's problems (search.py), Optuna's side
of it (studies.py) and worker processes sharing the studies (workers.py). It never imports the CLI."""
