"""The tuning loop. It never imports the CLI.

job.py             search jobs (the YAML files), parsed and checked
search.py          run_search: check everything, open or join the run, search it, export
workers.py         worker processes, one per GPU, sharing the run's studies; their coordinator
loop.py            WorkerLoop: one worker's passes over the job's problems
problem_search.py  ProblemSearch: one problem's ask -> claim -> measure -> store -> tell
sharing.py         SharedStudy: a study shared by workers under the results DB's lock
grid.py            Grid: what is left of a grid search's points, and points queued again
starts.py          StartingConfigs: the default, warm-start and probe configs queued first
run.py             RunRef, ProblemResult, ResultsReport: a run and its problems' results
provenance.py      versions and GPU fields that runs and best configs record
studies.py         Optuna's side: storages, samplers, heartbeats, worker names, hand-backs"""
