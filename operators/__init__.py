"""hetflow.operators: distributed dataframe operators on Arrow over MPI.

A standalone library: it imports nothing else of hetflow.
"""
