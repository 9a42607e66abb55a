from django.apps import AppConfig


class AgentConfig(AppConfig):
    name = "apps.agent"
    label = "agent"
