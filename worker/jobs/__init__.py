"""Serve jobs: a job turned into one request to vLLM, and the SDK's job loop that runs it.

:mod:`~worker.jobs.routing` and :mod:`~worker.jobs.forms` turn a job's input into one request
(pure); :mod:`~worker.jobs.handler` sends it and relays vLLM's answer;
:mod:`~worker.jobs.jobloop` drives the runpod SDK's loop over its session to the job API
(:mod:`~worker.jobs.jobapi`); :mod:`~worker.jobs.stats` its optional stats lines. Imports
:mod:`worker.config`, :mod:`worker.errors` and :mod:`worker.secrets`.
"""
