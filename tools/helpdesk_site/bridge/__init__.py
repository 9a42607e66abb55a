"""faultdesk's own additions to its helpdesk deployment: a bootstrap command for what the REST API
cannot create (queue, custom field, API user and token) and two read-only views the stock API
lacks (find a ticket by a custom-field value; read one ticket cheaply)."""
