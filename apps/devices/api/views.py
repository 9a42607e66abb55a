"""Device API: the principal's tenant's devices (to pick one when filing a request)."""

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.api import HasPrincipal, request_principal
from apps.devices.models import Device
from apps.devices.selectors import device_list


class DeviceSerializer(serializers.ModelSerializer):
    class Meta:
        model = Device
        fields = ["id", "asset_tag", "name", "kind", "model", "site", "criticality", "state", "alert_code",
                  "alert_message", "version", "updated_at"]


class DeviceListApi(APIView):
    permission_classes = [HasPrincipal]

    @extend_schema(responses=DeviceSerializer(many=True))
    def get(self, request):
        qs = device_list(principal=request_principal(request))
        if tag := request.query_params.get("asset_tag"):
            qs = qs.filter(asset_tag=tag)
        return Response(DeviceSerializer(qs[:500], many=True).data)
