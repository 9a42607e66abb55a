from django import forms
from django.utils.translation import gettext_lazy as _

from apps.tasks.models import Urgency


class FaultRequestForm(forms.Form):
    device = forms.ChoiceField(label=_("Device"))
    symptom = forms.CharField(label=_("What is wrong?"), widget=forms.Textarea(attrs={"rows": 4}), max_length=4000)
    urgency = forms.ChoiceField(label=_("Urgency"), choices=Urgency.choices, initial=Urgency.NORMAL)

    def __init__(self, *args, devices=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["device"].choices = [
            (d.pk, f"{d.asset_tag} — {d.name} ({d.site}) [{d.get_state_display()}]") for d in devices
        ]


class InputForm(forms.Form):
    text = forms.CharField(label=_("Your answer"), widget=forms.Textarea(attrs={"rows": 3}), max_length=4000)
