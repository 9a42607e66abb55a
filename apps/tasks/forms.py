from django import forms
from django.utils.translation import gettext_lazy as _

from apps.attachments.limits import limits
from apps.tasks.models import Urgency


class MultipleFileInput(forms.ClearableFileInput):
    allow_multiple_selected = True


class AttachmentsField(forms.FileField):
    """Any number of files, handed on unchecked: the attachments service checks them all by their
    content (apps/attachments/content.py) and reports every problem at once."""

    widget = MultipleFileInput

    def clean(self, data, initial=None):
        return [f for f in (data if isinstance(data, list | tuple) else [data]) if f]


class FaultRequestForm(forms.Form):
    device = forms.ChoiceField(label=_("Device"))
    symptom = forms.CharField(label=_("What is wrong?"), widget=forms.Textarea(attrs={"rows": 4}), max_length=4000)
    urgency = forms.ChoiceField(label=_("Urgency"), choices=Urgency.choices, initial=Urgency.NORMAL)
    attachments = AttachmentsField(
        label=_("Photos, logs or PDF documents"), required=False,
        widget=MultipleFileInput(attrs={"accept": "image/png,image/jpeg,image/gif,image/webp,application/pdf,"
                                                  "text/plain,.log,.txt,.csv,.json,.xml,.cfg,.conf,.ini,.out"}))

    def __init__(self, *args, devices=(), **kwargs):
        super().__init__(*args, **kwargs)
        cap = limits()
        self.fields["attachments"].help_text = _(
            "Optional: up to %(files)s files (photos, text logs, PDF), at most %(mb)s MB each.") % {
            "files": cap["files"], "mb": round(cap["file_bytes"] / 2**20)}
        self.fields["device"].choices = [
            (d.pk, f"{d.asset_tag} — {d.name} ({d.site}) [{d.get_state_display()}]") for d in devices
        ]


class InputForm(forms.Form):
    text = forms.CharField(label=_("Your answer"), widget=forms.Textarea(attrs={"rows": 3}), max_length=4000)
