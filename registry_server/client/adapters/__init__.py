"""The registry's tools as agent frameworks' own tool objects.

One module per framework, each importing its framework only when imported
itself (the frameworks are optional extras):

- ``openai_agents``: ``toolreg_function_tools`` gives the OpenAI Agents SDK's
  ``FunctionTool``s; dangerous tools pause the run through the SDK's
  ``needs_approval``, and ``ToolregApprovals.resolve`` settles those pauses from
  toolreg's approval requests (``pip install 'toolreg[openai-agents]'``);
- ``langchain``: ``toolreg_structured_tools`` gives LangChain
  ``StructuredTool``s; a call that needs approval pauses a LangGraph graph with
  ``interrupt`` and resumes with ``Command(resume=...)``
  (``pip install 'toolreg[langchain]'``).

Both list tools with ListTools, so ``max_level`` and ``categories`` filter
exactly as GetToolSchemas does, and both send every call through ExecuteTool:
the server validates the arguments, applies the policy and the approvals, and
runs the sandbox. docs/how-to/agent-frameworks.md explains the mapping.
"""
