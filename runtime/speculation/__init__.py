"""Medusa speculation: draft trees and the policy that picks one per batch."""
