"""The operator's policy: who may do what, approval rules, sandbox ceilings;
its file format and loader.
"""
