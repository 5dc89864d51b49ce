"""(package docstring)"""
