"""`forerun bench`: measured speed, every figure a ratio against plain decoding in the same run.

workloads.py reads the prompt sets, runner.py runs baseline / methods / peers side by side,
peers.py wraps Hugging Face transformers and llama-cpp-python, report.py turns runs into a
table, JSON and a plot, command.py is the command line.
"""
