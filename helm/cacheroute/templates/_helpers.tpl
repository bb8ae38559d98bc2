{{/* Names and labels shared by every template. */}}

{{- define "cacheroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-<chart>, or the release name alone when it already holds the chart name. */}}
{{- define "cacheroute.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "cacheroute.operatorName" -}}
{{- printf "%s-operator" (include "cacheroute.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "cacheroute.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "cacheroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cacheroute
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "cacheroute.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "cacheroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "cacheroute.operatorLabels" -}}
{{ include "cacheroute.labels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "cacheroute.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "cacheroute.operatorName" .) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* repository:tag, or repository@digest when a digest is given. */}}
{{- define "cacheroute.image" -}}
{{- $image := .Values.operator.image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (toString (default .Chart.AppVersion $image.tag)) -}}
{{- end -}}
{{- end -}}

{{- define "cacheroute.routerImage" -}}
{{- default (include "cacheroute.image" .) .Values.router.image -}}
{{- end -}}

{{/* The namespaces the operator serves; fails early on a watch list that cannot work. */}}
{{- define "cacheroute.watchedNamespaces" -}}
{{- if not .Values.operator.watch.allNamespaces -}}
{{- if not .Values.operator.watch.namespaces -}}
{{- fail "operator.watch.namespaces must name at least one namespace when operator.watch.allNamespaces is false" -}}
{{- end -}}
{{- toJson .Values.operator.watch.namespaces -}}
{{- end -}}
{{- end -}}

{{/* What the schema cannot say of router and engine values, refused at render rather than by the
operator at its start (the same checks, cacheroute.operator.config). */}}
{{- define "cacheroute.checkDefaults" -}}
{{- range $group := list "router" "engine" -}}
{{- $values := index $.Values $group -}}
{{- if ge (int $values.drainSeconds) (int $values.terminationGracePeriodSeconds) -}}
{{- fail (printf "%s.drainSeconds (%d) must be shorter than %s.terminationGracePeriodSeconds (%d): the kubelet kills the pod when its grace period ends, drained or not" $group (int $values.drainSeconds) $group (int $values.terminationGracePeriodSeconds)) -}}
{{- end -}}
{{- end -}}
{{- range $where, $resources := dict "router.resources" .Values.router.resources "router.envoy.resources" .Values.router.envoy.resources -}}
{{- range $section := list "requests" "limits" -}}
{{- range $name, $amount := (index $resources $section | default dict) -}}
{{- if not (regexMatch "^\\+?([0-9]+(\\.[0-9]*)?|\\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][-+]?[0-9]+)?$" (toString $amount)) -}}
{{- fail (printf "%s.%s.%s %q is not a quantity (such as 500m, 2, 256Mi, 1Gi)" $where $section $name (toString $amount)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The operator's configuration file (`--config`): router and engine defaults, as the operator reads them. */}}
{{- define "cacheroute.operatorConfig" -}}
{{- include "cacheroute.checkDefaults" . -}}
{{- $router := deepCopy .Values.router -}}
{{- $_ := set $router "image" (include "cacheroute.routerImage" .) -}}
{{- $config := dict "clusterDomain" .Values.operator.clusterDomain "router" $router "engine" .Values.engine "profiling" .Values.operator.profiling -}}
{{- toYaml $config -}}
{{- end -}}
