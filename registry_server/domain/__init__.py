"""Tool definitions, their checks, call outcomes and errors: plain data and
rules, importing nothing else of toolreg.
"""
