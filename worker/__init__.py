"""Runpod Serverless worker for vLLM."""
