"""Structured outputs: constraints a request's text must match (JSON Schema, any JSON object,
regex, grammar, choice), compiled by llguidance and applied as a token mask before sampling."""
from .compile_pool import CompileJob, CompilePool, CompileTimeout, CompilerBusy
from .compiler import CompiledConstraint, ConstraintCompiler
from .constraint import CONSTRAINT_TYPES, Choice, Constraint, ConstraintError, Grammar, JsonObject, JsonSchema, Regex
from .matcher import GrammarMatcher, TreeWalk

__all__ = ["CONSTRAINT_TYPES", "Choice", "CompileJob", "CompilePool", "CompileTimeout", "CompiledConstraint",
           "CompilerBusy", "Constraint", "ConstraintCompiler", "ConstraintError", "Grammar", "GrammarMatcher", "JsonObject", "JsonSchema", "Regex", "TreeWalk"]
